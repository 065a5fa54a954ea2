"""Experiment tracking beside metrics.jsonl (--report_to tensorboard | wandb): each tracker gets the same metrics."""
import json
import os

import pytest

import config
import da3po


def test_tensorboard_gets_the_metrics(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    cfg = config.parse_config(da3po.Config, ["--demo", "arith", "--steps", "2", "--out_dir", str(tmp_path),
                                                  "--prompts_per_step", "8", "--eval_size", "10", "--eval_samples", "2",
                                                  "--report_to", "tensorboard"], da3po.PRESETS)
    da3po.main(cfg)
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    records = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    for key in ("train/loss", "train/reward", "eval/acc", "daa/amplified_frac"):
        logged = [(e.step, e.value) for e in events.Scalars(key)]
        expected = [(r["step"], r[key]) for r in records if key in r]
        assert [s for s, _ in logged] == [s for s, _ in expected]
        assert all(v == pytest.approx(x, rel=1e-6) for (_, v), (_, x) in zip(logged, expected)), key
    assert "config" in events.Tags()["tensors"] or "config/text_summary" in events.Tags()["tensors"]


def wandb_history(path: str) -> list[dict]:
    """The history records of an offline wandb run, read back from its run-<id>.wandb transaction log: a 7-byte file
    header, then LevelDB-style log records in 32 KiB blocks (each with a 7-byte header: crc32c, length, type; type 1
    = a whole record, 2/3/4 = its first/middle/last piece), each record a wandb_internal_pb2.Record."""
    import struct
    from wandb.proto import wandb_internal_pb2
    data = open(path, "rb").read()
    assert data[:4] == b":W&B"
    pos, piece, history = 7, b"", []
    while pos + 7 <= len(data):
        left = 32768 - pos % 32768
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7]) if left >= 7 else (0, 0, 0)
        if left < 7 or (length == 0 and kind == 0):  # the zero-filled tail of a block
            pos += left
            continue
        piece += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(piece)
            piece = b""
            if record.WhichOneof("record_type") == "history":
                history.append({i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in record.history.item})
    return history


def test_wandb_offline_gets_the_metrics(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    cfg = config.parse_config(da3po.Config, ["--demo", "arith", "--steps", "2", "--out_dir", str(tmp_path),
                                                  "--prompts_per_step", "8", "--eval_size", "10", "--eval_samples", "2",
                                                  "--report_to", "wandb"], da3po.PRESETS)
    da3po.main(cfg)
    import wandb
    wandb.finish()  # what the exit hook does at the end of a real run
    # finish() can return before wandb's service process has written the transaction log (3 of 16 tries here found
    # only its 7-byte header); teardown() waits for the service to exit, as a real run's exit does (32 of 32 complete).
    wandb.teardown()
    runs = [d for d in os.listdir(tmp_path / "wandb") if d.startswith("offline-run-")]
    assert len(runs) == 1
    log = next(f for f in os.listdir(tmp_path / "wandb" / runs[0]) if f.endswith(".wandb"))
    path = str(tmp_path / "wandb" / runs[0] / log)
    history = wandb_history(path)
    keys = sorted({k for h in history for k in h})
    seen = f"{os.path.getsize(path)} bytes, {len(history)} history records, keys {keys}"
    records = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    for key in ("train/loss", "eval/acc", "daa/lam_mean"):
        logged = [(h["_step"], h[key]) for h in history if key in h]
        assert logged == [(r["step"], pytest.approx(r[key])) for r in records if key in r], f"{key}; the log: {seen}"
