// Models that write other programs' formats (tk/export.h).
#include "tk/export.h"

namespace tk {

ModelWithExport::~ModelWithExport() = default;

const ModelWithExport* export_of(const Model& model) { return dynamic_cast<const ModelWithExport*>(&model); }

}  // namespace tk
