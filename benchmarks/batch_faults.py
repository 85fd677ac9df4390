"""The batch runner under faults and bad input: the reliability figures of docs/batches.md.

    python benchmarks/batch_faults.py       # 12 minutes on a 2-core machine under load

Every fault is real: runner processes started here and stopped by the PID this script started
(Ctrl-C, SIGKILL), a kernel killed by its own PID, a job past its timeout, a second runner on the
same --out. For each it counts the jobs kept (finished jobs whose job.json says ok and whose
metrics.json reads) and checks what must not happen (a kernel outliving its runner, a hidden
.partial folder left, a planned job missing from results.csv). Then it feeds the command line
bad input and counts the refusals: exit status 2, one line on stderr, no folder created, no
kernel started. Fixture notebooks only (tests/conftest.py), so no model is trained.
"""
from __future__ import annotations

import csv
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
from conftest import HALF_BODY, OK_BODY, make_notebook  # noqa: E402

PY = sys.executable


def cli(*args, **kw):
    return [PY, "-m", "workbench.cli", *map(str, args)]


def wait_for(cond, timeout=180, proc=None):
    t0 = time.time()
    while not cond():
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(proc.stdout.read() if proc.stdout else "runner exited")
        if time.time() - t0 > timeout:
            raise TimeoutError
        time.sleep(0.2)


def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def kept(out: Path) -> tuple[int, int, list[str]]:
    """(jobs kept ok, jobs planned, statuses in results.csv)"""
    plan = json.loads((out / "plan.json").read_text())
    ok = 0
    for j in plan["jobs"]:
        d = out / j["dir"]
        try:
            if json.loads((d / "job.json").read_text())["status"] == "ok":
                json.loads((d / "metrics.json").read_text())
                ok += 1
        except (OSError, ValueError, KeyError):
            pass
    subprocess.run(cli("report", out, "--no-html"), capture_output=True)
    with open(out / "results.csv") as f:
        statuses = [r["status"] for r in csv.DictReader(f)]
    return ok, len(plan["jobs"]), statuses


def main() -> int:
    tmp = Path(tempfile.mkdtemp(prefix="batch-faults-"))
    nbd = tmp / "notebooks"
    nbd.mkdir()
    ok_nb = make_notebook(nbd / "01-ok.ipynb", OK_BODY, "x: int = 1  # a number [-9..9]\n")
    half = make_notebook(nbd / "07-half.ipynb", HALF_BODY)
    sleeper = make_notebook(
        nbd / "09-sleeps.ipynb",
        "import os, pathlib, time\npathlib.Path(pidfile).write_text(str(os.getpid()))\n"
        "time.sleep(sleep_s)\nimport workbench\n"
        "run = workbench.start('09-sleeps', scale=scale, seed=seed, device='cpu', out_dir=out_dir)\n"
        "run.finish()",
        'pidfile: str = ""  # where the kernel writes its pid\n'
        "sleep_s: float = 120.0  # how long to sleep [0..]\n")
    ok_pid = make_notebook(nbd / "02-ok.ipynb", OK_BODY.replace("01-ok", "02-ok"),
                           "x: int = 1  # a number\npidfile: str = \"\"  # unused here\n")
    rows = []

    def fault(name, planned_ok, out, extra=""):
        ok, planned, statuses = kept(out)
        partial = list(out.rglob("*.partial*"))
        rows.append((name, f"{ok}/{planned_ok}", len(statuses) == planned,
                     not partial, extra))
        print(f"{name}: kept {ok}/{planned_ok} finished jobs; report lists {len(statuses)}/"
              f"{planned} planned ({', '.join(statuses)}); .partial left: {len(partial)} {extra}",
              flush=True)

    # 1. a job past its timeout beside one that finishes: the kernel dies before the commit
    out, pid = tmp / "f1", tmp / "k1.pid"
    subprocess.run(cli("run", ok_pid, sleeper, "-p", "pidfile", pid, "--jobs", "2",
                       "--timeout", "45", "--out", out), capture_output=True, text=True)
    fault("timeout", 1, out, f"kernel alive after the runner: {alive(int(pid.read_text()))}")
    # 2. a kernel killed by its PID mid-run
    out, pid = tmp / "f2", tmp / "k2.pid"
    p = subprocess.Popen(cli("run", ok_pid, sleeper, "-p", "pidfile", pid, "--jobs", "2",
                             "--out", out, "--timeout", "300"), stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True)
    wait_for(lambda: pid.exists() and any((out / "02-ok").rglob("job.json")), proc=p)
    os.kill(int(pid.read_text()), signal.SIGKILL)
    text = p.communicate(timeout=120)[0]
    cell = "cell 3: import os, pathlib, time ... (running)" in text
    fault("kernel killed", 1, out, f"dead job names its running cell: {cell}")
    # 3, 4. the runner stopped by Ctrl-C, and killed, by the PID this script started
    for sig, label in ((signal.SIGINT, "runner Ctrl-C"), (signal.SIGKILL, "runner SIGKILL")):
        out, pid = tmp / f"f-{sig}", tmp / f"k-{sig}.pid"
        p = subprocess.Popen(cli("run", ok_nb, half, "--jobs", "2", "--out", out,
                                 "--timeout", "300"), env=dict(os.environ, WB_TEST_HANG=str(pid)),
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        wait_for(lambda: pid.exists() and (out / "01-ok/smoke/seed-0/job.json").exists(), proc=p)
        p.send_signal(sig)
        p.communicate(timeout=120)
        kernel = int(pid.read_text())
        t0 = time.time()
        while alive(kernel) and time.time() - t0 < 20:
            time.sleep(0.2)
        fault(label, 1, out, f"rc {p.returncode}; kernel gone after {time.time() - t0:.1f} s")
        if sig == signal.SIGKILL:       # the next run on the folder removes what it left
            r = subprocess.run(cli("run", ok_nb, half, "--jobs", "2", "--out", out, "--resume"),
                               capture_output=True, text=True)
            fault("  then --resume", 2, out, f"rc {r.returncode}")
    # 5. a second runner on the same --out while the first runs
    out, pid = tmp / "f5", tmp / "k5.pid"
    p = subprocess.Popen(cli("run", sleeper, "-p", "pidfile", pid, "-p", "sleep_s", "5",
                             "--seeds", "0,1", "--jobs", "1", "--out", out),
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    wait_for(pid.exists, proc=p)
    second = subprocess.run(cli("run", ok_nb, "--out", out), capture_output=True, text=True)
    p.communicate(timeout=300)
    fault("second runner on one --out", 2, out,
          f"second refused with rc {second.returncode}: {second.stderr.strip()[:60]}...")

    # bad input: every one refused with exit 2, one line, nothing created, no kernel
    bad = tmp / "bad"
    afile = tmp / "afile"
    afile.write_text("x")
    broken = nbd / "10-broken.ipynb"
    broken.write_text(ok_nb.read_text()[:300])
    cases = [
        ("--jobs 0", [ok_nb, "--jobs", "0"]), ("--jobs -3", [ok_nb, "--jobs", "-3"]),
        ("--timeout -5", [ok_nb, "--timeout", "-5"]), ("--timeout 0", [ok_nb, "--timeout", "0"]),
        ("--retries -1", [ok_nb, "--retries", "-1"]), ("--seeds x", [ok_nb, "--seeds", "x"]),
        ("--out an existing file", [ok_nb, "--out", afile]),
        ("--out under a file", [ok_nb, "--out", afile / "sub"]),
        ("--out /proc/out", [ok_nb, "--out", "/proc/out"]),
        ("unknown notebook", ["99-nothing"]), ("path-like name", ["../x"]),
        ("unknown parameter", [ok_nb, "-p", "nope", "1"]),
        ("wrong type", [ok_nb, "-p", "x", "abc"]),
        ("outside a declared limit", [ok_nb, "-p", "x", "10"]),
        ("-p seed (reserved)", [ok_nb, "-p", "seed", "1"]),
        ("-p given twice", [ok_nb, "-p", "x", "1", "-p", "x", "2"]),
        ("unclosed bracket", [ok_nb, "-p", "x", "[1,2"]),
        ("empty grid value", [ok_nb, "-p", "x", "1,,2"]),
        ("broken notebook", [broken]),
        ("17 -p pattern_length 9", ["17-rnn-abstraction", "-p", "pattern_length", "9"]),
        ("12 -p steps -5", ["12-nfi", "-p", "steps", "-5"]),
        ("12 --seeds -1", ["12-nfi", "--seeds", "-1"]),
        ("no notebook named", []),
    ]
    refused, worst = 0, 0.0
    for label, args in cases:
        argv = cli("run", *args) + ([] if "--out" in map(str, args) else ["--out", bad])
        t0 = time.time()
        r = subprocess.run(argv, capture_output=True, text=True, cwd=tmp)
        dt = time.time() - t0
        worst = max(worst, dt)
        err = [ln for ln in r.stderr.splitlines() if ln.strip()]
        one_line = len(err) == 1 or (err and err[-1].startswith("workbench run: error"))
        good = r.returncode == 2 and one_line and not bad.exists() and "Traceback" not in r.stderr
        refused += good
        print(f"  {'refused' if good else 'NOT REFUSED'} ({dt:.1f} s) {label}: {err[-1] if err else ''}")
    print(f"bad input refused: {refused}/{len(cases)} (exit 2, one line, nothing created); "
          f"slowest refusal {worst:.1f} s")
    print(json.dumps({"faults": rows, "bad_input": [refused, len(cases)], "tmp": str(tmp)}))
    return 0 if refused == len(cases) else 1


if __name__ == "__main__":
    sys.exit(main())
