"""The block loop's predicted efficiency (issue 55 item 5): the committed file is what the code
makes of the committed rates and bytes, the model adds up, and the GPU session sets each
prediction beside its measurement."""

import json

import pytest

from benchmarks.gpu import block_loop_prediction as blp
from benchmarks.gpu import session as gpu_session


def test_committed_prediction_is_current():
    preds = blp.predictions()
    assert blp.OUT.read_text() == blp.markdown(preds)
    assert json.loads(blp.OUT.with_suffix(".json").read_text()) == [blp.asdict(p) for p in preds]
    assert {(p.world, p.team) for p in preds} == {(8, 2), (16, 4)}


def test_the_model_adds_kernels_and_bytes():
    rows = [{"case": "P8 C2 MHA 16x128 dense, cuDNN adapter", "world": 8, "team": 2, "heads": 16, "kv_heads": 16,
             "kernel": "torch_cuda_cudnn", "schedule_bytes": 2e9, "adapter_bytes": 1.35e9}]
    p = blp.predict(8, 2, 16, 16, rows)
    assert p.bytes_ms == pytest.approx(1.0)  # 3.35 GB at 3.35 TB/s
    assert p.rank_tflop == pytest.approx(246.3 / 8, rel=1e-3)  # gpu_rates: 246.3 TFLOP for the whole 128K at 16 x 128
    assert p.fused_share_ms == pytest.approx(440.4 / 8, rel=1e-3)  # the measured fused call over P
    # fewer bytes: a higher predicted efficiency
    assert blp.predict(8, 2, 16, 16, [{**rows[0], "adapter_bytes": 0}]).predicted_efficiency > p.predicted_efficiency
    with pytest.raises(ValueError, match="regenerate"):
        blp.predict(16, 4, 16, 16, rows)


def test_the_session_prints_prediction_beside_measurement():
    fused = {"kind": "fused", "tokens": 131072, "heads": 16, "kv_heads": 16, "head_dim": 128, "dtype": "bf16",
             "ms": 440.0}
    rank = {"kind": "rank", "tokens": 131072, "world": 8, "team": 2, "heads": 16, "kv_heads": 16, "head_dim": 128,
            "dtype": "bf16", "kernel": "torch_cuda_cudnn", "rank_ms": 68.75}
    preds = [blp.asdict(p) for p in blp.predictions()]
    lines = gpu_session.prediction_table([fused, rank, {**rank, "tokens": 1048576}], preds)
    want = blp.lookup(preds, 8, 2, 16, 16)
    assert lines[2:] == [f"| 8 | 2 | 16/16 | torch_cuda_cudnn | 68.75 | {want['predicted_ms']:.1f} | 0.80 | "
                         f"{want['predicted_efficiency']:.2f} (torch_cuda_cudnn) |"]


def test_help_and_no_write_leave_the_committed_files_alone(tmp_path, capsys):
    """``--help`` prints the usage (test_documented_commands runs it) and writes nothing; ``--out``
    writes the table elsewhere, ``--no-write`` only prints it."""
    out = tmp_path / "prediction.txt"  # (the table, markdown; its .json beside it)
    with pytest.raises(SystemExit) as exit_:
        blp.main(["--help", "--out", str(out)])
    assert exit_.value.code == 0 and "usage" in capsys.readouterr().out and not out.exists()
    assert blp.main(["--no-write", "--out", str(out)]) == 0 and not out.exists()
    assert blp.main(["--out", str(out)]) == 0
    assert out.read_text() == blp.OUT.read_text() and out.with_suffix(".json").exists()
