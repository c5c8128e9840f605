"""The profiler window (config.profile, tfjax.runner.profiling): a trace of whole train steps in
TensorBoard's layout, the compiled HLO, clipping, resuming and refused values. One run (the
module's fixture); the rest checks the window's bookkeeping without training."""

import logging
import os

import jax
import ml_collections
import pytest
from conftest import ROOT, set_fields
from jax.profiler import ProfileData

from tfjax.runner import profiling, train


def lm_config(data_dir, **overrides):
    """Tiny causal LM, 3 steps; no checkpoint or log line inside the window (smaller traces)."""
    config = train.load_config(os.path.join(ROOT, "configs/lm.py:tiny"))
    config.data_dir = data_dir
    config.update(num_train_steps=3, log_every=100, eval_every=0, eval_steps=1)
    config.checkpoint.every = 0
    return set_fields(config, overrides)


def messages_in(logs, text):
    return [m for m in logs if text in m]


@pytest.fixture(scope="module")
def profiled(data_dir, tmp_path_factory):
    """A run whose window (steps 2-5) is clipped to its 3 steps, HLO dumped, XLA compilations
    logged: {"workdir", "logs": the messages it logged}."""
    workdir = str(tmp_path_factory.mktemp("profiled"))
    config = lm_config(
        data_dir, **{"profile.start_step": 2, "profile.num_steps": 4, "profile.dump_hlo": True}
    )
    records = []
    handler = logging.Handler(logging.DEBUG)
    handler.emit = records.append
    loggers = [logging.getLogger(name) for name in ("absl", "jax._src.dispatch")]
    level = loggers[0].level
    for logger in loggers:
        logger.addHandler(handler)
    loggers[0].setLevel(logging.INFO)
    try:
        with jax.log_compiles():  # "Finished XLA compilation of jit(train_step) ..."
            train.train_and_evaluate(config, workdir)
    finally:
        for logger in loggers:
            logger.removeHandler(handler)
        loggers[0].setLevel(level)
    return dict(workdir=workdir, logs=[r.getMessage() for r in records])


def session_files(workdir):
    base = os.path.join(workdir, "profile", "plugins", "profile")
    return {s: sorted(os.listdir(os.path.join(base, s))) for s in os.listdir(base)}


def test_the_trace_is_in_tensorboards_layout_and_non_empty(profiled):
    workdir = profiled["workdir"]
    # WORKDIR/profile is a TensorBoard run dir: plugins/profile/<session>/<host>.xplane.pb
    sessions = session_files(workdir)
    assert list(sessions) == ["steps_2-3"]
    files = sessions["steps_2-3"]
    assert any(f.endswith(".xplane.pb") for f in files), files
    for f in files:
        assert os.path.getsize(os.path.join(workdir, "profile/plugins/profile/steps_2-3", f)) > 0
    [line] = [m for m in profiled["logs"] if m.startswith("Profile of steps 2-3:")]
    assert os.path.join(workdir, "profile", "plugins", "profile", "steps_2-3") in line
    assert f"tensorboard --logdir {workdir}" in line and "run profile/steps_2-3" in line


def test_the_trace_holds_exactly_the_window_s_whole_steps(profiled):
    [xplane] = [
        f for f in session_files(profiled["workdir"])["steps_2-3"] if f.endswith(".xplane.pb")
    ]
    data = ProfileData.from_file(
        os.path.join(profiled["workdir"], "profile/plugins/profile/steps_2-3", xplane)
    )
    launches, device_runs = set(), 0
    for plane in data.planes:
        for line in plane.lines:
            for event in line.events:
                stats = dict(event.stats)
                if stats.get("name") != "jit_train_step":  # the XLA executable's runs
                    continue
                if "run_id" in stats:  # the host's launch of one step
                    launches.add(stats["run_id"])
                elif "global_device_id" in stats:  # one device's part of it
                    device_runs += 1
    # Steps 2 and 3 and nothing of step 1 (ready before the trace began): on all 8 devices.
    assert len(launches) == 2
    assert device_runs == 2 * jax.device_count()


def test_a_window_past_the_end_is_clipped_and_logged(profiled):
    assert messages_in(
        profiled["logs"], "profile window (steps 2-5) is clipped to steps 2-3: num_train_steps=3"
    )


def test_dump_hlo_writes_the_optimized_train_step_compiled_once(profiled):
    path = os.path.join(profiled["workdir"], "profile", profiling.HLO_FILE)
    with open(path) as f:
        text = f.read()
    assert text.startswith("HloModule jit_train_step")
    assert "\nENTRY " in text and "is_scheduled=true" in text  # after XLA's passes
    # lower().compile() for the dump and the loop's first call share one executable.
    compiles = messages_in(profiled["logs"], "Finished XLA compilation of jit(train_step)")
    assert len(compiles) == 1, compiles


def window_config(start_step, num_steps, *, eval_every=0, checkpoint_every=0):
    """The fields of a 10-step run's config that a Window reads."""
    return ml_collections.ConfigDict(
        dict(
            profile=dict(start_step=start_step, num_steps=num_steps, dump_hlo=False),
            num_train_steps=10,
            eval_every=eval_every,
            checkpoint=dict(every=checkpoint_every),
        )
    )


def window_logs(caplog, tmp_path, config, *, first_step, last_step):
    """Runs a Window over steps first_step..last_step as the loop does (no arrays are needed
    when nothing is traced); (the messages it logged, the files it wrote)."""
    with caplog.at_level(logging.INFO):
        window = profiling.Window(config, str(tmp_path), first_step=first_step, last_step=last_step)
        for step in range(first_step, last_step + 1):
            window.begin(step, None)
            assert not window.end(step, None)
        window.close()
    return [r.getMessage() for r in caplog.records], os.listdir(tmp_path)


@pytest.mark.parametrize("first_step", [3, 6])  # within the window, after it
def test_a_run_resumed_past_the_window_start_traces_nothing(caplog, tmp_path, first_step):
    logs, files = window_logs(
        caplog, tmp_path, window_config(2, 4), first_step=first_step, last_step=10
    )
    assert logs == [
        f"No profile window (steps 2-5): this run resumes at step {first_step}, past its start."
    ]
    assert files == []


def test_stop_after_step_before_the_window_traces_nothing_in_that_call(caplog, tmp_path):
    logs, files = window_logs(caplog, tmp_path, window_config(2, 4), first_step=1, last_step=1)
    assert logs == [
        "No profile window (steps 2-5) in this call: it stops after step 1; continue to trace it."
    ]
    assert files == []


def test_evaluations_and_checkpoints_inside_the_window_are_named(caplog):
    with caplog.at_level(logging.INFO):
        profiling.Window(
            window_config(2, 4, eval_every=2, checkpoint_every=3),
            "unused",
            first_step=1,
            last_step=10,
        )
    assert [r.getMessage() for r in caplog.records] == [
        "The profile window (steps 2-5) also traces the evaluation after step 2, checkpoint "
        "after step 3, evaluation after step 4."
    ]


def test_a_window_cut_short_keeps_its_steps_and_frees_the_profiler(caplog, tmp_path):
    """A run stopped inside the window (a signal, an error): close() writes what was traced,
    and the profiler is free again (the next run in this process can trace)."""
    config = window_config(1, 3)
    double = jax.jit(lambda x: 2 * x, donate_argnums=0)
    with caplog.at_level(logging.INFO):
        for _ in range(2):  # the same window twice (a rewound run): both traces are kept
            window = profiling.Window(config, str(tmp_path), first_step=1, last_step=10)
            x = jax.numpy.ones(4)
            with jax.log_compiles():
                window.maybe_compile(double, (x,))  # the window starts at the first step
                compiled = len(caplog.records)
                window.begin(1, x)
                x = double(x)
                assert not window.end(1, x)
            # The first step was compiled before the trace began, not inside it.
            assert not messages_in(
                [r.getMessage() for r in caplog.records[compiled:]], "Finished XLA compilation"
            )
            window.close()  # stopped before step 2
    logs = [r.getMessage() for r in caplog.records]
    base = tmp_path / "profile" / "plugins" / "profile"
    assert sorted(os.listdir(base)) == ["steps_1-3", "steps_1-3_2"]
    for session in os.listdir(base):
        assert any(f.endswith(".xplane.pb") for f in os.listdir(base / session))
        [line] = messages_in(logs, f"{base / session} (")
        assert line.startswith("Profile of steps 1-1 (the run stopped before step 3): ")


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"profile.num_steps": -1}, "profile.num_steps must be an integer >= 0, got -1"),
        (
            {"profile.start_step": 0, "profile.num_steps": 1},
            "profile.start_step must be an integer >= 1, got 0",
        ),
        (
            {"profile.start_step": 4, "profile.num_steps": 1},
            "profile.start_step=4 is after num_train_steps=3: the window would trace nothing",
        ),
    ],
)
def test_bad_values_are_refused_in_a_line_before_the_workdir_is_written(
    data_dir, tmp_path, overrides, message
):
    with pytest.raises(ValueError) as e:
        train.train_and_evaluate(lm_config(data_dir, **overrides), str(tmp_path / "run"))
    assert str(e.value) == message
    assert not os.path.exists(tmp_path / "run")


def test_a_window_after_the_end_is_fine_while_profiling_is_off(data_dir):
    profiling.check_profile(lm_config(data_dir, **{"profile.start_step": 10}))  # num_steps=0
