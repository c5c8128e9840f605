"""What the benchmarks share: their common flags, timing in rotated rounds (in this process, or
one process per contender), medians, ratio lines, the machine's description and the JSON file.

A benchmark run as a script has its own folder first on sys.path, so `import harness` finds
this file. It imports neither JAX nor torch: a contender's process loads only its own library.
"""

import argparse
import json
import os
import platform
import re
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from importlib import metadata

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "benchmarks", "results")  # gitignored
FIRST_STEP = re.compile(r"First step \(compilation included\): ([0-9.]+)s")  # the runner's line


def log(message=""):
    print(message, flush=True)


def parser(doc: str, name: str, *, tiny: bool = True) -> argparse.ArgumentParser:
    """The flags every benchmark has: --out (default benchmarks/results/<name>.json) and, where
    it has toy sizes for the smoke tests, --tiny. `doc`'s first paragraph is the description."""
    p = argparse.ArgumentParser(description=doc.split("\n\n")[0].strip())
    p.add_argument("--out", default=os.path.join(RESULTS, f"{name}.json"), help="results JSON")
    if tiny:
        p.add_argument("--tiny", action="store_true", help="toy sizes (smoke test)")
    return p


def use_cores(threads: int = 0) -> int:
    """Keeps this process on its first `threads` cores (0: all it may use) and returns how many
    it has. Call it before JAX or torch start their thread pools."""
    cores = sorted(os.sched_getaffinity(0))
    if threads and threads < len(cores):
        os.sched_setaffinity(0, cores[:threads])
    # libgomp's default busy-waiting makes torch's 2-thread steps 100x slower when other
    # processes share the cores (measured: 650 ms vs 5 ms for a tiny step); sleep instead.
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    return len(os.sched_getaffinity(0))


# ----------------------------------------------------------------------------------- timing
def rotated(names: list, r: int) -> list:
    """`names` starting at the r-th: each round another contender goes first, so that the load
    drifts of a shared machine hit all alike."""
    r %= len(names)
    return names[r:] + names[:r]


def block(result):
    """Waits for JAX's asynchronous results (torch's and plain values are ready already)."""
    if "jax" in sys.modules:
        sys.modules["jax"].block_until_ready(result)
    return result


def timed_call(fn):
    """(results, seconds) of one call of `fn`, its results ready."""
    start = time.perf_counter()
    result = block(fn())
    return result, time.perf_counter() - start


def timed(fn) -> float:
    """Seconds of one call of `fn`, its results ready."""
    return timed_call(fn)[1]


def time_rounds(calls: dict, rounds: int, *, warmup: int = 1) -> dict:
    """{name: [seconds per round]}: every call of `calls` ({name: fn}) run `warmup` times
    untimed (compilation), then timed once a round in rotated order."""
    for fn in calls.values():
        for _ in range(warmup):
            block(fn())
    names = list(calls)
    times = {n: [] for n in names}
    for r in range(rounds):
        for n in rotated(names, r):
            times[n].append(timed(calls[n]))
    return times


def medians(times: dict) -> dict:
    return {name: statistics.median(t) for name, t in times.items()}


def target_note(value: float, *, at_most=None, at_least=None) -> str:
    """The note after a figure: '  (target <= 1.0: met)', '  (target >= 3.0: MISSED)', or ''
    without a target."""
    if at_most is None and at_least is None:
        return ""
    met = value <= at_most if at_most is not None else value >= at_least
    bound = f"<= {at_most}" if at_most is not None else f">= {at_least}"
    return f"  (target {bound}: {'met' if met else 'MISSED'})"


def ratio_line(name: str, value: float, *, digits: int = 3, **target) -> str:
    """'ratio <name> = <value>' and target_note(value, **target)."""
    return f"ratio {name} = {value:.{digits}f}{target_note(value, **target)}"


# --------------------------------------------------------------- one process per contender
REPLY = "@@ "  # marks a contender process's answers on its stdout (libraries may print too)


def _reply(**fields):
    print(REPLY + json.dumps(fields, default=float), flush=True)


def serve(build, *, warmup: int):
    """The contender's side, in its own process: `build()` -> (step, info), one first step
    (compilation) and `warmup` more, then one timed step per "step" line on stdin until any
    other line. Answers are REPLY lines of JSON; a contender that cannot run here answers why."""
    try:
        start = time.perf_counter()
        step, info = build()
        info["build_s"] = time.perf_counter() - start
        start = time.perf_counter()
        info["first_loss"] = step()  # compiles (jit, torch.compile) and runs one step
        info["first_step_s"] = time.perf_counter() - start
        for _ in range(warmup):
            step()
    except Exception as e:  # noqa: BLE001 - reported, not fatal
        _reply(error=f"{type(e).__name__}: {str(e)[:2000]}")
        return
    _reply(ready=True, **info)
    for line in sys.stdin:
        if line.strip() != "step":
            break
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        start = time.perf_counter()
        step()
        seconds = time.perf_counter() - start
        usage = resource.getrusage(resource.RUSAGE_SELF)
        _reply(s=seconds, page_faults=usage.ru_minflt - faults, max_rss_kib=usage.ru_maxrss)


class Contender:
    """A contender in its own process (`command` ends in a call of serve()), so that no
    library's threads, allocator or JIT state slows another: in one process, torch slowed the
    JAX contenders unevenly."""

    def __init__(self, command: list[str]):
        self.stderr = tempfile.TemporaryFile(mode="w+")
        self.proc = subprocess.Popen(
            command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.stderr, text=True
        )

    def ask(self, line=None) -> dict:
        if line is not None:
            self.proc.stdin.write(line + "\n")
            self.proc.stdin.flush()
        for out in self.proc.stdout:
            if out.startswith(REPLY):
                return json.loads(out[len(REPLY) :])
        self.stderr.seek(0)
        tail = self.stderr.read()[-1500:]
        return {"error": f"worker exited with code {self.proc.wait()}: {tail}"}

    def close(self):
        if self.proc.poll() is None:
            self.proc.stdin.write("quit\n")
            self.proc.stdin.close()
            self.proc.wait()
        self.stderr.close()


def time_processes(commands: dict, rounds: int) -> dict:
    """Starts, warms up and times contenders, one process each ({label: command}).

    They start one after another (so that no compilation shares the cores) and wait idle on
    stdin while the others run; then each round times one step of each in rotated order. A
    contender that does not start is left out, its reason kept as "<label>_error"; the
    contenders' own "ready" fields (parameter counts, FLOPs) are kept as they are."""
    workers, build_s, first_s, losses, info = {}, {}, {}, {}, {}
    try:
        for c, command in commands.items():
            w = Contender(command)
            reply = w.ask()
            if "error" in reply:
                log(f"  {c}: did not start: {reply['error'][:500]}")
                info[f"{c}_error"] = reply["error"]
                w.close()
                continue
            workers[c] = w
            build_s[c], first_s[c] = reply.pop("build_s"), reply.pop("first_step_s")
            losses[c] = reply.pop("first_loss")
            info.update({k: v for k, v in reply.items() if k != "ready"})
            log(f"  {c}: built in {build_s[c]:.1f} s, first step (compile) {first_s[c]:.1f} s")
        names = list(workers)
        times, faults, rss = ({c: [] for c in names} for _ in range(3))
        for r in range(rounds):
            for c in rotated(names, r):
                reply = workers[c].ask("step")
                if "error" in reply:
                    raise RuntimeError(f"{c} failed in round {r + 1}: {reply['error']}")
                times[c].append(reply["s"])
                faults[c].append(reply["page_faults"])
                rss[c].append(reply["max_rss_kib"])
            log(f"  round {r + 1}: " + ", ".join(f"{c} {1e3 * times[c][-1]:.0f} ms" for c in names))
    finally:
        for w in workers.values():
            w.close()
    return dict(
        contenders=names,
        build_s=build_s,
        first_step_s=first_s,
        first_loss=losses,
        step_s=times,
        median_s=medians(times),
        page_faults=faults,
        max_rss_gib={c: max(r) / 2**20 for c, r in rss.items()},
        **info,
    )


# ------------------------------------------------------------------------------ the record
def version(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def machine(*packages: str) -> dict:
    """Python, the platform, the CPU, its cores and load, and the versions of `packages`."""
    cpu = platform.processor()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if "model name" in line)
    except (OSError, StopIteration):
        pass
    return {
        "python": platform.python_version(),
        **{p: version(p) for p in packages},
        "platform": platform.platform(),
        "cpu": cpu,
        "cores_visible": os.cpu_count(),
        "cores_used": len(os.sched_getaffinity(0)),
        "XLA_FLAGS": os.environ.get("XLA_FLAGS", ""),
        "load_average": os.getloadavg(),
    }


def header(benchmark: str, args, *packages: str) -> dict:
    """What a result file starts with: the benchmark, whether it ran --tiny, and the machine
    with the versions of `packages`."""
    return dict(benchmark=benchmark, tiny=args.tiny, machine=machine(*packages))


def write_json(path: str, result) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(result, f, indent=1, default=float)
    log(f"wrote {path}")


def launch_runner(config: str, env: dict, args=(), *, marker: str | None = None, log=log) -> dict:
    """Runs experiments/run.py once in a fresh workdir (removed after) and times it: seconds from
    launch to its first step (to_first_step_s), the first step's own as the runner logs it
    (first_step_s), the whole run (total_s), and with `marker` how many output lines hold it
    (marked). A failed run logs its last lines and raises."""
    workdir = tempfile.mkdtemp(prefix="tfjax_runner_bench_")
    cmd = [
        sys.executable,
        os.path.join(ROOT, "experiments/run.py"),
        f"--config={config}",
        f"--workdir={workdir}",
        *args,
    ]
    start = time.perf_counter()
    proc = subprocess.Popen(
        cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    first_step = to_first = None
    marked, tail = 0, []
    for line in proc.stdout:
        tail = (tail + [line])[-30:]
        marked += marker is not None and marker in line
        m = FIRST_STEP.search(line)
        if m and first_step is None:
            first_step, to_first = float(m.group(1)), time.perf_counter() - start
    rc = proc.wait()
    total = time.perf_counter() - start
    shutil.rmtree(workdir, ignore_errors=True)
    if rc != 0 or first_step is None:
        log("".join(tail))
        raise RuntimeError(f"{' '.join(cmd)} failed (exit {rc})")
    return dict(first_step_s=first_step, to_first_step_s=to_first, total_s=total, marked=marked)
