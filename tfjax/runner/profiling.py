"""A profiler window of a training run: a jax.profiler trace of whole train steps, and the
compiled train step's HLO, in WORKDIR/profile.

    --config.profile.start_step=10 --config.profile.num_steps=3   # trace steps 10, 11, 12
    --config.profile.dump_hlo=True          # and keep the train step's HLO (any num_steps)

What is written (jax.profiler's layout, which TensorBoard's profile plugin reads):

  WORKDIR/profile/plugins/profile/steps_10-12/<host>.xplane.pb      the trace (all tools)
                                              <host>.trace.json.gz  its trace-viewer events
  WORKDIR/profile/train_step.hlo.txt        the optimized HLO the loop runs (dump_hlo)

`tensorboard --logdir WORKDIR` (with `pip install tensorboard-plugin-profile`) lists it in its
Profile tab as run "profile/steps_10-12", next to the scalars of WORKDIR/tensorboard.

The trace holds whole steps: the state is ready before step start_step is dispatched, and the
trace stops once the last traced step's state is ready; in between it holds everything the
loop did (input batches, logging of earlier steps). A run resumed at or past start_step traces
nothing (a part of the window would read as the whole); a window past the run's last step is
clipped to it. When the window begins at the run's first step, that step is compiled before
the trace starts, so the trace shows the step rather than XLA compiling it.

Only process 0 traces and writes: every process runs the same SPMD program, so its trace shows
the step; and jax.profiler names its files by host, so several processes on one host (a
process per GPU, local CPU tests) would write over each other's files.

The HLO comes from `train_step.lower(state, batch, rng).compile()` on the first step's own
arguments: jit keeps that executable and the loop's first call reuses it, so the train step is
compiled once, as without the dump.
"""

from __future__ import annotations

import os

import jax
from absl import logging

DIR = "profile"  # in the workdir
HLO_FILE = "train_step.hlo.txt"


def check_profile(config) -> None:
    """Raises ValueError when config.profile's window lies after the run (what each field
    allows on its own: `tfjax.runner.defaults.PROFILE`)."""
    p = config.get("profile")
    if p is None:
        return
    if p.num_steps and p.start_step > config.num_train_steps:
        raise ValueError(
            f"profile.start_step={p.start_step} is after num_train_steps="
            f"{config.num_train_steps}: the window would trace nothing"
        )


class Window:
    """The profile of one run of the loop (one train_and_evaluate call); process 0 only.

    The loop calls, for each step k (1-based, as logged):
      maybe_compile(train_step, args)   on the run's first step, before its dispatch
      begin(k, state)                   before dispatching step k
      end(k, outputs) -> bool           after dispatching step k; True when a trace ended
      close()                           at the end, and on errors: a trace still running stops
    """

    def __init__(self, config, workdir: str, *, first_step: int, last_step: int):
        """config: the run's config (config.profile; no field: off); first_step, last_step:
        the steps this call of the loop runs (first_step - 1 is the step it resumes from)."""
        profile = config.get("profile")
        self.directory = os.path.join(workdir, DIR)
        self.dump_hlo = bool(profile and profile.dump_hlo)
        self.start = self.stop = None  # the traced steps, when any
        self.session = None  # the trace's directory while tracing
        self._done = None  # the newest step dispatched while tracing
        self._first_step = first_step
        if not profile or not profile.num_steps:
            return
        start, stop = profile.start_step, profile.start_step + profile.num_steps - 1
        window = f"profile window (steps {start}-{stop})"
        if start < first_step:
            logging.info("No %s: this run resumes at step %d, past its start.", window, first_step)
            return
        if start > last_step:  # only with stop_after_step (check_profile refuses the rest)
            logging.info(
                "No %s in this call: it stops after step %d; continue to trace it.",
                window,
                last_step,
            )
            return
        if stop > last_step:
            why = (
                f"num_train_steps={config.num_train_steps}"
                if last_step == config.num_train_steps
                else f"this call stops after step {last_step}"
            )
            logging.warning("The %s is clipped to steps %d-%d: %s.", window, start, last_step, why)
            stop = last_step
        # What the loop does after a traced step, before the next one, is in the trace too.
        also = [
            f"{what} after step {k}"
            for k in range(start, stop)
            for what, every in (
                ("evaluation", config.eval_every),
                ("checkpoint", config.checkpoint.every),
            )
            if every and k % every == 0
        ]
        if also:
            logging.info("The %s also traces the %s.", window, ", ".join(also))
        if jax.process_index() == 0:
            self.start, self.stop = start, stop

    def maybe_compile(self, train_step, args) -> None:
        """Compiles the train step ahead of its first call when its HLO is dumped or its trace
        begins at once (the jitted call then reuses the executable: no second compile)."""
        if not (self.dump_hlo or self.start == self._first_step):
            return
        # A step loaded from config.compiled_dir is already compiled.
        compiled = train_step.lower(*args).compile() if hasattr(train_step, "lower") else train_step
        if self.dump_hlo and jax.process_index() == 0:
            text = compiled.as_text()
            os.makedirs(self.directory, exist_ok=True)
            path = os.path.join(self.directory, HLO_FILE)
            with open(path + ".tmp", "w") as f:
                f.write(text)
            os.replace(path + ".tmp", path)  # never a half-written file
            logging.info(
                "Compiled HLO of the train step: %s (%.1f KB; the executable the loop "
                "runs, compiled once)",
                path,
                len(text) / 1e3,
            )

    def begin(self, step: int, state) -> None:
        """Starts the trace before step `step` is dispatched, once `state` is ready (so no
        earlier step runs inside it)."""
        if step != self.start:
            return
        jax.block_until_ready(state)
        name = f"steps_{self.start}-{self.stop}"
        session, n = name, 1
        while os.path.exists(os.path.join(self.directory, "plugins", "profile", session)):
            n += 1  # a window traced again (a rewound run): keep the earlier trace
            session = f"{name}_{n}"
        options = jax.profiler.ProfileOptions()
        options.session_id = session  # the directory's name (jax's default: a timestamp)
        try:
            jax.profiler.start_trace(self.directory, profiler_options=options)
        except RuntimeError as e:  # a trace around the whole run (jax.profiler.trace) runs
            logging.warning("No profile window: jax.profiler could not start (%s).", e)
            self.start = self.stop = None
            return
        self.session = os.path.join(self.directory, "plugins", "profile", session)

    def end(self, step: int, outputs) -> bool:
        """Stops the trace once step `step`, the last traced, has its `outputs` ready."""
        if self.session is None:
            return False
        self._done = step
        if step != self.stop:
            return False
        jax.block_until_ready(outputs)
        self._stop(step)
        return True

    def close(self) -> None:
        """Stops a trace still running (the run stopped early): it holds the steps until now."""
        if self.session is None:
            return
        try:
            self._stop(self._done)
        except Exception as e:  # noqa: BLE001 (on an error's way out: that error matters)
            logging.warning("The profile trace could not be written: %s", e)

    def _stop(self, step: int | None) -> None:
        """Ends the trace after step `step` (None: before the first traced step ended)."""
        session, self.session = self.session, None
        jax.profiler.stop_trace()
        files = sorted(os.listdir(session)) if os.path.isdir(session) else []
        sizes = ", ".join(
            f"{f} {os.path.getsize(os.path.join(session, f)) / 1e6:.2f} MB" for f in files
        )
        if step == self.stop:
            steps = f"steps {self.start}-{step}"
        elif step is None:
            steps = f"a part of step {self.start} (the run stopped during it)"
        else:
            steps = f"steps {self.start}-{step} (the run stopped before step {self.stop})"
        workdir = os.path.dirname(self.directory)
        logging.info(
            "Profile of %s: %s (%s). Open it with `tensorboard --logdir %s` (pip "
            "install tensorboard-plugin-profile), Profile tab, run %s/%s.",
            steps,
            session,
            sizes or "no files",
            workdir,
            DIR,
            os.path.basename(session),
        )
