// A strategy as plugin API 1 wrote it (events(), on_event(), option_specs(), init(const Options&),
// TK_PLUGIN with three arguments). check_sdk.sh compiles it against the installed headers: the
// compiler must refuse it with messages that point to the porting tables of the plugin guide.
#include <tk/abi.h>

#include <vector>

class Api1 : public tk::Plugin {
 public:
  tk::EventSet events() const override { return {tk::Event::Boundary}; }
  std::vector<tk::OptionSpec> option_specs() const override { return {}; }
  void init(const tk::Options& o) override { steps_ = o.get_int("steps"); }
  void on_event(tk::Event e, tk::Context& ctx) override {}

 private:
  int64_t steps_ = 1;
};

TK_PLUGIN(Api1, "api1", "1.0")
