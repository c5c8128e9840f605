"""Smoke runs of the benchmarks on toy sizes: they run, print their ratios, write their JSON.

No timing is asserted (benchmarks are never timed tests). About a minute on an idle 2-core
CPU, most of it JAX compilation and the two runner launches of compile_time's cache part.
"""

import json

import pytest
from conftest import run_python


def _run(script, out, *args):
    # Without conftest's 8 host devices: they are not what a benchmark measures.
    proc = run_python(f"benchmarks/{script}", "--tiny", f"--out={out}", *args)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    with open(out) as f:
        return proc.stdout, json.load(f)


@pytest.mark.slow
def test_train_step_vs_torch_tiny(tmp_path):
    # One model and no torch.compile (~30 s of inductor compilation even for a toy model) keep
    # the test short; the full run covers ViT and torch.compile (or reports why it failed).
    out, result = _run(
        "train_step_vs_torch.py",
        tmp_path / "train_step.json",
        "--models=decoder",
        "--contenders=tfjax,stock_flax,torch_eager",
        "--rounds=1",
        "--warmup=0",
    )
    for model in ("decoder",):
        assert f"[{model}] params" in out
        assert set(result["summary"][model]["ratios"]) == {
            "tfjax/stock_flax",
            "tfjax/torch_eager",
        }
        assert result["results"][model]["flops"] > 0
    assert out.count("ratio tfjax/torch_eager = ") == 1
    assert out.count("ratio tfjax/stock_flax = ") == 1
    assert result["roofline_flops"] > 0 and result["machine"]["jax"]
    # The matmuls-alone ceiling counts the FLOPs of tfjax.runner.chips (which adds biases, norms).
    summary = result["summary"]["decoder"]
    flops = result["results"]["decoder"]["flops"]
    assert summary["matmul_flops"] == pytest.approx(flops, rel=0.05)  # biases, norms aside
    assert set(summary["mfu_of_matmuls_alone"]) == {"jax", "torch"}


@pytest.mark.slow
def test_compile_time_tiny(tmp_path):
    out, result = _run(
        "compile_time.py",
        tmp_path / "compile_time.json",
        "--depths=1,2",
        "--cache_modes=env_cache",
    )
    assert "ratio scan L=2/L=1 (lower + compile) = " in out
    assert "ratio unrolled L=2/L=1 (lower + compile) = " in out
    assert "ratio env_cache cold/warm first step (compile) = " in out
    assert set(result["depth"]["rows"]) == {"1/unrolled", "1/scan", "2/unrolled", "2/scan"}
    assert result["cache"]["modes"]["env_cache"]["median"]["warm"]["first_step_s"] >= 0


@pytest.mark.slow
def test_saved_executables_tiny(tmp_path):
    out, result = _run("saved_executables.py", tmp_path / "saved_executables.json")
    assert "ratio compile/saved launch to first step = " in out
    assert "ratio compile/saved whole run = " in out
    assert [x["loaded"] for x in result["runs"]["saved"]] == [3]  # init, train and eval
    assert [x["loaded"] for x in result["runs"]["compile"]] == [0]
    assert result["saved_bytes"] > 0 and result["median"]["saved"]["first_step_s"] >= 0


@pytest.mark.slow
def test_attention_layouts_tiny(tmp_path):
    out, result = _run("attention_layouts.py", tmp_path / "attention_layouts.json", "--rounds=1")
    for model in ("vit", "decoder"):
        assert f"[{model}]" in out
        assert set(result["results"][model]["ratios"]) == {
            f"tfjax/{base} {p}"
            for base in ("token_major", "torch_sdpa")
            for p in ("fwd", "fwd+bwd")
        }


@pytest.mark.slow
def test_train_checkpoint_tiny(tmp_path):
    out, result = _run("train_checkpoint.py", tmp_path / "train_checkpoint.json")
    for layout in ("scanned", "unrolled"):
        assert f"{layout}: async save blocks the loop for " in out
        r = result["results"][layout]
        assert r["async_s"]["blocks"] > 0 and r["sync_s"]["durable"] >= r["sync_s"]["blocks"]
    # Stacking the layers is what reduces the number of arrays saved.
    assert result["results"]["scanned"]["arrays"] < result["results"]["unrolled"]["arrays"]


@pytest.mark.slow
def test_host_memory_tiny(tmp_path):
    out, result = _run(
        "host_memory.py",
        tmp_path / "host_memory.json",
        "--models=decoder",
        "--rounds=2",
        "--warmup=0",
    )
    assert "step time keep/glibc = " in out
    row = result["results"]["decoder"]
    assert row["ratio keep/glibc"] > 0
    assert all(row[s]["max_rss_gib"] > 0 and len(row[s]["step_s"]) == 2 for s in ("glibc", "keep"))


@pytest.mark.slow
def test_load_memory_tiny(tmp_path):
    out, result = _run("load_memory.py", tmp_path / "load_memory.json", "--scan_layers")
    assert "ratio extra copies streamed = " in out
    assert "ratio load peak growth streamed/whole = " in out
    rows = result["rows"]
    assert set(rows) == {"whole", "streamed"}
    # Both ways placed the same parameters: the checkpoint's, whole.
    assert rows["whole"]["placed"] == rows["streamed"]["placed"] == result["checkpoint_bytes"]


@pytest.mark.slow
def test_moe_dispatch_tiny(tmp_path):
    out, result = _run("moe_dispatch.py", tmp_path / "moe_dispatch.json")
    assert "ratio ragged/dense fwd time (cpu) = " in out
    assert "ratio ragged/dense fwd+bwd time (cpu) = " in out
    (row,) = result["results"]
    assert row["max_abs_difference"] < 1e-5  # the two ways compute the same outputs
    assert set(row["seconds"]) == {
        f"{w} {p}" for w in ("ragged", "dense") for p in ("fwd", "fwd+bwd")
    }
    assert all(c["flops"] > 0 for c in row["compiled_cost"].values())
    # Compiled for a TPU chip where libtpu is installed (this suite's), else the reason.
    tpu = row["tpu_cost"]
    assert "error" in tpu or tpu["ragged"]["fwd"]["flops"] < tpu["dense"]["fwd"]["flops"]


@pytest.mark.slow
def test_decode_layout_tiny(tmp_path):
    out, result = _run("decode_layout.py", tmp_path / "decode_layout.json")
    assert "same tokens: True" in out and "ratio speed auto / as-given = " in out
    assert [r["layout"] for r in result["rows"]] == ["as-given", "auto"]
    assert all(r["tokens_per_s"] > 0 for r in result["rows"])


@pytest.mark.slow
def test_batch_fit_tiny(tmp_path):
    out, result = _run("batch_fit.py", tmp_path / "batch_fit.json")
    assert "per extra row: " in out and "largest fitting batch: " in out
    tried = {t["rows"]: t["fits"] for t in result["tried"]}
    largest = result["largest_rows"]
    # The bisection's answer: that batch fits and the next one does not (or is past the cap).
    assert tried[largest] and (result["capped_by_max_rows"] or tried[largest + 1] is False)
    assert all(fits == (rows <= largest) for rows, fits in tried.items())
    assert result["slope_bytes_per_row"] > 0


@pytest.mark.slow
def test_nnx_step_tiny(tmp_path):
    out, result = _run("nnx_step.py", tmp_path / "nnx_step.json")
    assert "ratio step time nnx/linen = " in out
    assert result["first_loss"]["nnx"] == pytest.approx(result["first_loss"]["linen"], rel=1e-6)
    assert set(result["seconds"]) == {"linen", "nnx"}


def test_label_logit_tiny(tmp_path):
    """Both forms run here with equal losses and gradients (the script checks), and compile for
    a TPU slice, where the masked sum's peak is printed beside the gather's."""
    out, result = _run("label_logit.py", tmp_path / "here.json")
    assert "ratio time masked sum / gather = " in out and result["time_ratio"] > 0
    out, result = _run("label_logit.py", tmp_path / "tpu.json", "--topology=v5p:2x2x1")
    assert "ratio peak masked sum / gather = " in out
    assert result["gather"]["compiled"] and result["masked sum"]["peak_bytes"] > 0


@pytest.mark.slow
def test_delta_rule_tiny(tmp_path):
    out, result = _run("delta_rule.py", tmp_path / "delta_rule.json")
    assert "ratio chunked/attention time at T=" in out
    rows = result["rows"]
    assert [r["length"] for r in rows] == [64, 96]
    # The chunked form computed what the recurrent one did (the script checks to 1e-4).
    assert all(r["max_abs_difference"] < 1e-4 for r in rows)
    assert all(set(r["median_ms"]) == {"chunked", "recurrent", "attention"} for r in rows)


def test_cache_memory_tiny(tmp_path):
    """Latent attention's cache grows by the latent and the shared rotated key a token and layer
    (deepseek-tiny: 3 layers of 16 + 4 in bfloat16), far less than the same heads' keys and
    values; a grouped-query cache by its kv heads' keys and values; a linear-attention state
    not at all."""
    out, result = _run("cache_memory.py", tmp_path / "cache_memory.json")
    rows = {row["preset"]: row for row in result["rows"]}
    assert rows["deepseek-tiny"]["kinds"]["latent"]["bytes_per_token"] == 3 * (16 + 4) * 2
    assert rows["deepseek-tiny"]["per_head_bytes_per_token"] == 3 * 4 * (8 + 4 + 6) * 2
    assert rows["modern-tiny"]["kinds"]["kv"]["bytes_per_token"] == 2 * 2 * 2 * 8 * 2
    # qwen3.5-tiny: the 3 Gated DeltaNet layers' states do not grow; its one full-attention
    # layer caches 2 kv heads of 16
    qwen = rows["qwen3.5-tiny"]["kinds"]
    assert qwen["recurrent"]["bytes_per_token"] == 0 and qwen["recurrent"]["constant_bytes"] > 0
    assert qwen["kv"]["bytes_per_token"] == 1 * 2 * 2 * 16 * 2
    assert "ratio deepseek-tiny latent/per_head = 0.2778" in out
