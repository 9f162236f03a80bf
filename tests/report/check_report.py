#!/usr/bin/env python3
"""tk-report and tk-run --report on real runs: completed ones (k = 4 x 32 next to one batch of 128,
one with a vetoed step), a failed one, one killed mid-run, one still being written (its folder locked,
its last line torn), one with no metrics yet and one with a damaged line.

Without --browser it checks what the pages hold (the data tk-report embeds) and the tools' messages.
With --browser it loads every page from disk in headless Chromium and checks what the page drew: no
errors or console output, every chart's series with as many points as metrics.jsonl has values, and
the overlay of two runs with one series per run. Exit 77 (ctest: skipped) when --browser is asked
and there is no Chromium.

  check_report.py --tk-run EXE --tk-report EXE --recipe quickstart.toml --plugins DIR --work DIR [--browser]
"""
import argparse
import fcntl
import html
import json
import os
import re
import shutil
import stat
import subprocess
import sys

SKIP = 77


def fail(msg):
    print("FAIL: " + msg)
    sys.exit(1)


def expect(cond, msg):
    if not cond:
        fail(msg)


def records(run_dir):
    out = []
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        for line in f:
            try:
                r = json.loads(line)
            except ValueError:
                continue
            if isinstance(r, dict) and isinstance(r.get("step"), int):
                out.append(r)
    return out


def embedded(page):
    """The data tk-report put into the page."""
    with open(page, encoding="utf-8") as f:
        text = f.read()
    m = re.search(r'<script id="tk-data" type="application/json">(.*?)</script>', text, re.S)
    expect(m, page + ": no embedded data")
    expect("<script src" not in text and "<link" not in text and "http://" not in text.split("<script>")[0],
           page + ": the page refers to another file")
    return json.loads(m.group(1))


class Runs:
    def __init__(self, a):
        self.a = a
        self.env = dict(os.environ, TK_PLUGIN_PATH=a.plugins)
        with open(a.recipe) as f:
            self.base = f.read()

    def run(self, name, extra_plugin="", sets=(), env=None, expect_rc=0, report=True):
        out = os.path.join(self.a.work, name)
        recipe = os.path.join(self.a.work, name + ".toml")
        with open(recipe, "w") as f:
            f.write(self.base + extra_plugin)
        cmd = [self.a.tk_run, recipe, "--overwrite", "--progress", "none", "--set", "run.output=" + out,
               "--set", "run.epochs=1", "--set", "data.samples=2048", "--set", "data.validation_samples=512",
               "--set", "run.validate_every=4"]
        for s in sets:
            cmd += ["--set", s]
        if report:
            cmd.append("--report")
        p = subprocess.run(cmd, env=dict(self.env, **(env or {})), capture_output=True, text=True, timeout=600)
        expect(p.returncode == expect_rc, "%s: tk-run exit %d, expected %d\n%s%s" % (name, p.returncode, expect_rc,
                                                                                  p.stdout, p.stderr))
        return out, p

    def report(self, dirs, out, expect_rc=0):
        p = subprocess.run([self.a.tk_report, *dirs, "-o", out], capture_output=True, text=True, timeout=120)
        expect(p.returncode == expect_rc, "tk-report %s: exit %d\n%s%s" % (dirs, p.returncode, p.stdout, p.stderr))
        return p


def check_pages(a):
    r = Runs(a)
    probe = '\n[[plugins]]\nname = "probe"\n'
    accum, _ = r.run("accum-4x32", probe + "veto_at_step = 3\n", sets=["run.phase_times=true"])
    big, _ = r.run("batch-128", sets=["batch.accumulation=1", "batch.micro_batch=128"])
    failed, p = r.run("failed", probe + "throw_at_step = 5\n", expect_rc=1)
    expect("report: " in p.stdout, "failed run: tk-run --report did not say it wrote the report\n" + p.stdout + p.stderr)
    killed, _ = r.run("killed", env={"TK_FAULT": "metrics-written:6"}, expect_rc=-9, report=False)
    for d in (accum, big, failed):
        expect(os.path.exists(os.path.join(d, "report.html")), d + ": tk-run --report wrote no report.html")

    # A run still being written: its folder locked by a live process, its last record torn.
    live = os.path.join(a.work, "live")
    shutil.rmtree(live, ignore_errors=True)
    shutil.copytree(accum, live)
    with open(os.path.join(live, "metrics.jsonl")) as f:
        lines = f.readlines()
    with open(os.path.join(live, "metrics.jsonl"), "w") as f:
        f.writelines(lines[:10])
        f.write(lines[10][: len(lines[10]) // 2])
    with open(os.path.join(live, "status.json"), "w") as f:
        json.dump({"status": "running", "step": 10, "pid": os.getpid()}, f)
    # A folder with the recipe only (a run that has not recorded a step), and one with a bad line.
    empty = os.path.join(a.work, "no-steps")
    shutil.rmtree(empty, ignore_errors=True)
    os.makedirs(empty)
    shutil.copy(os.path.join(accum, "recipe.toml"), empty)
    damaged = os.path.join(a.work, "damaged")
    shutil.rmtree(damaged, ignore_errors=True)
    shutil.copytree(big, damaged)
    with open(os.path.join(damaged, "metrics.jsonl")) as f:
        lines = f.readlines()
    lines.insert(2, "{not json\n")
    with open(os.path.join(damaged, "metrics.jsonl"), "w") as f:
        f.writelines(lines)

    pages = {}
    pages["overlay"] = os.path.join(a.work, "overlay.html")
    r.report([accum, big], pages["overlay"])
    pages["accum"] = os.path.join(accum, "report.html")
    pages["failed"] = os.path.join(failed, "report.html")
    pages["all"] = os.path.join(a.work, "all.html")
    with open(os.path.join(live, ".tk-lock"), "a+") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        p = r.report([accum, big, failed, killed, live, empty, damaged], pages["all"])
    expect(re.search(r"damaged/metrics\.jsonl:3: not a metrics record", p.stderr),
           "a damaged line is not reported with its file and line:\n" + p.stderr)
    p = r.report([os.path.join(a.work, "nowhere")], os.path.join(a.work, "x.html"), expect_rc=2)
    expect("nowhere: no such folder" in p.stderr, "a missing folder: " + p.stderr)
    # Its default page would go into it: the folder is named as no run, not as no place for the page.
    p = subprocess.run([a.tk_report, os.path.join(a.work, "nowhere")], capture_output=True, text=True, timeout=120)
    expect(p.returncode == 2 and "nowhere: no such folder" in p.stderr, "a missing folder, no -o: " + p.stderr)
    p = r.report([a.work], os.path.join(a.work, "x.html"), expect_rc=2)
    expect("not a run's output folder" in p.stderr, "a folder that is not a run: " + p.stderr)
    check_outputs_refused(r, accum)
    garbage = os.path.join(r.a.work, "garbage-status")
    shutil.rmtree(garbage, ignore_errors=True)
    shutil.copytree(big, garbage)
    with open(os.path.join(garbage, "status.json"), "w") as f:
        f.write("\x00\x01 not json")
    p = r.report([garbage], os.path.join(r.a.work, "garbage.html"))
    expect("garbage-status/status.json: damaged" in p.stderr, "a damaged status.json is not warned about: " + p.stderr)

    # What the pages hold.
    d = embedded(pages["all"])
    by = {os.path.basename(x["path"]): x for x in d["runs"]}
    status = {k: v["status"]["status"] for k, v in by.items()}
    expect(status == {"accum-4x32": "completed", "batch-128": "completed", "failed": "failed", "killed": "interrupted",
                      "live": "running", "no-steps": "unknown", "damaged": "completed"}, "statuses: %s" % status)
    expect("injected failure" in by["failed"]["status"].get("detail", ""), "the failure's message: %s" % by["failed"]["status"])
    expect(by["live"]["status"].get("pid") == os.getpid(), "the live run's holder: %s" % by["live"]["status"])
    expect(len(by["live"]["steps"]["step"]) == 10 and any("incomplete" in n for n in by["live"]["notes"]),
           "the live run's torn last line: %d steps, notes %s" % (len(by["live"]["steps"]["step"]), by["live"]["notes"]))
    expect(by["no-steps"]["steps"] == {} and any("no metrics.jsonl" in n for n in by["no-steps"]["notes"]),
           "a run without metrics: %s" % by["no-steps"])
    for name, run_dir in (("accum-4x32", accum), ("batch-128", big), ("failed", failed), ("killed", killed)):
        recs = [x for x in records(run_dir) if "loss" in x]
        got = by[name]["steps"]["step"]
        expect(got == [x["step"] for x in recs], "%s: steps in the page differ from metrics.jsonl" % name)
    expect(by["damaged"]["skipped_lines"] == 1, "damaged: skipped_lines %s" % by["damaged"].get("skipped_lines"))
    expect(len(by["killed"]["steps"]["step"]) == 6, "killed at the 6th record: %d steps" % len(by["killed"]["steps"]["step"]))
    expect(any(e["key"] == "skipped" and e["step"] == 4 for e in by["accum-4x32"]["events"]),
           "the vetoed step's note: %s" % by["accum-4x32"]["events"])
    ra, rb = by["accum-4x32"]["recipe"], by["batch-128"]["recipe"]
    expect(ra.get("batch.accumulation") == "4" and rb.get("batch.accumulation") == "1" and
           ra.get("batch.micro_batch") == "32" and rb.get("batch.micro_batch") == "128",
           "the recipes' values: %s / %s" % ({k: v for k, v in ra.items() if "grad_accum" in k}, rb.get("batch.micro_batch")))
    print("pages: %d runs read, statuses %s" % (len(by), status))
    return pages, {"accum-4x32": accum, "batch-128": big, "failed": failed, "killed": killed, "live": live,
                   "damaged": damaged}


def check_outputs_refused(r, run_dir):
    """-o never writes over what is not a report: a run's own files, a folder, a device, a link."""
    metrics = os.path.join(run_dir, "metrics.jsonl")
    with open(metrics, "rb") as f:
        before = f.read()
    p = r.report([run_dir], metrics, expect_rc=2)
    expect("exists and is not a report of tk-report" in p.stderr, "-o metrics.jsonl: " + p.stderr)
    with open(metrics, "rb") as f:
        expect(f.read() == before, "-o metrics.jsonl changed the run's records")
    p = r.report([run_dir], "/dev/null", expect_rc=2)
    expect("/dev/null: is not a regular file" in p.stderr, "-o /dev/null: " + p.stderr)
    expect(stat.S_ISCHR(os.stat("/dev/null").st_mode), "/dev/null is no longer a character device")
    p = r.report([run_dir], run_dir, expect_rc=2)
    expect("is a folder" in p.stderr, "-o a folder: " + p.stderr)
    link = os.path.join(r.a.work, "link.html")
    if os.path.lexists(link):
        os.remove(link)
    os.symlink(metrics, link)
    p = r.report([run_dir], link, expect_rc=2)
    expect("is a link" in p.stderr, "-o a link: " + p.stderr)
    with open(metrics, "rb") as f:
        expect(f.read() == before, "-o a link to metrics.jsonl changed the run's records")
    notes = os.path.join(r.a.work, "notes.html")
    with open(notes, "w") as f:
        f.write("<html>my notes</html>\n")
    r.report([run_dir], notes, expect_rc=2)
    # A report is replaced (the one tk-run --report wrote, say).
    r.report([run_dir], os.path.join(run_dir, "report.html"))


def find_chromium():
    for name in ("chromium", "chromium-browser", "google-chrome"):
        path = shutil.which(name)
        if path:
            return path
    return None


def load_in_browser(chromium, page, work):
    profile = os.path.join(work, "chromium-profile")
    shutil.rmtree(profile, ignore_errors=True)
    cmd = [chromium, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
           "--disable-background-networking", "--disable-component-update", "--disable-sync",
           "--user-data-dir=" + profile, "--window-size=1400,2000", "--enable-logging=stderr", "--v=0",
           "--dump-dom", "file://" + os.path.abspath(page)]
    # The browser is not trainkit: under the sanitizers (tools/sanitize.sh) it runs without them.
    env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env)
    expect(p.returncode == 0, "%s: chromium exit %d\n%s" % (page, p.returncode, p.stderr[-3000:]))
    console = [line for line in p.stderr.splitlines() if ":CONSOLE" in line]
    expect(not console, "%s: the page wrote to the console:\n%s" % (page, "\n".join(console)))
    m = re.search(r'<pre id="tk-selfcheck"[^>]*>(.*?)</pre>', p.stdout, re.S)
    expect(m and m.group(1).strip(), page + ": the page did not finish drawing (no self-check)")
    check = json.loads(html.unescape(m.group(1)))
    expect(not check["errors"], "%s: errors in the page: %s" % (page, check["errors"]))
    return check


def check_browser(a, pages, dirs):
    chromium = find_chromium()
    if not chromium:
        print("SKIP: no chromium (tools/setup.sh installs it); the pages were checked without a browser")
        sys.exit(SKIP)
    names = {os.path.basename(v): v for v in dirs.values()}
    derived = {"throughput", "tokens_per_second", "skipped", "loss_smoothed"}
    for which, page in pages.items():
        check = load_in_browser(chromium, page, a.work)
        expect(check["charts"], "%s: no chart drawn" % which)
        for chart in check["charts"]:
            for s in chart["series"]:
                recs = records(names[s["run"]]) if s["run"] in names else None
                if recs is None:
                    fail("%s: a series of an unknown run %s" % (which, s["run"]))
                key = s["key"]
                if key == "loss_smoothed":
                    key = "loss"
                if chart["id"] == "phases":
                    key = re.search(r"\((.*)\)$", s["label"]).group(1) + "_ms"
                if chart["id"] == "memory":
                    key = {"process": "peak_rss_mib", "step tensors": "step_peak_mib", "budget": "memory_budget_mib"}[
                        re.search(r"\((.*)\)$", s["label"]).group(1)]
                if key in derived:
                    want_max = len([x for x in recs if "loss" in x])
                    expect(0 < s["points"] <= want_max, "%s: %s of %s: %d points" % (which, key, s["run"], s["points"]))
                    continue
                want = len([x for x in recs if isinstance(x.get(key), (int, float)) and not isinstance(x.get(key), bool)])
                expect(s["points"] == want, "%s: chart %s, series %s: %d points, metrics.jsonl has %d" % (
                    which, chart["id"], s["label"], s["points"], want))
        ids = {c["id"]: c for c in check["charts"]}
        for needed in ("loss", "validation_loss", "validation_accuracy", "lr", "effective_batch", "micro_batches",
                       "throughput", "memory"):
            expect(needed in ids, "%s: no %s chart (charts: %s)" % (which, needed, sorted(ids)))
        if which == "overlay":
            for cid in ("validation_loss", "lr", "effective_batch"):
                runs = [s["run"] for s in ids[cid]["series"]]
                expect(sorted(runs) == ["accum-4x32", "batch-128"], "overlay: chart %s has series %s" % (cid, runs))
            expect(len(ids["loss"]["series"]) == 4, "overlay: the loss chart has %d series" % len(ids["loss"]["series"]))
        if which == "accum":
            expect("skipped" in ids, "the run with a vetoed step has no skipped-steps chart")
            expect("phases" in ids and len(ids["phases"]["series"]) == 5,
                   "the run with run.phase_times has no chart of its 5 phases: %s" % ids.get("phases"))
        print("browser: %s: %d charts, %d series, no errors" % (
            which, len(check["charts"]), sum(len(c["series"]) for c in check["charts"])))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tk-run", required=True)
    ap.add_argument("--tk-report", required=True)
    ap.add_argument("--recipe", required=True)
    ap.add_argument("--plugins", required=True)
    ap.add_argument("--work", required=True)
    ap.add_argument("--browser", action="store_true")
    a = ap.parse_args()
    if a.browser and not find_chromium():
        print("SKIP: no chromium (tools/setup.sh installs it)")
        sys.exit(SKIP)
    os.makedirs(a.work, exist_ok=True)
    pages, dirs = check_pages(a)
    if a.browser:
        check_browser(a, pages, dirs)
    print("OK")


if __name__ == "__main__":
    main()
