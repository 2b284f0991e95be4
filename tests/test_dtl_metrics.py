"""dtl.metrics: the stable step line, TensorBoard event files, MFU arithmetic and peaks."""

import glob

import pytest

from dtl import metrics


def test_step_line_has_the_stable_format():
    line = metrics.format_step(
        12,
        100,
        loss=3.21449,
        lr=6e-4,
        grad_norm=0.912,
        dt_s=0.120,
        tokens_per_s=8533.3,
        mfu_value=0.412,
    )
    assert line == (
        "step 12/100 | loss 3.2145 | lr 6.0e-04 | grad_norm 0.91 | 120 ms | 8,533 tok/s | mfu 41.2%"
    )
    assert metrics.format_step(1, 2, loss=1.0, show_mfu=True) == "step 1/2 | loss 1.0000 | mfu n/a"


def test_mfu_is_model_flops_over_peak_times_devices():
    # 6 * 124M params * 100k tok/s = 74.4 TFLOP/s achieved on 1 of 312: 23.8%
    assert metrics.mfu(6 * 124e6, 100_000, 312e12) == pytest.approx(0.2385, abs=1e-4)
    assert metrics.mfu(6 * 124e6, 800_000, 312e12, n_devices=8) == pytest.approx(0.2385, abs=1e-4)
    assert metrics.mfu(1e9, 1e3, None) is None


def test_peak_is_unknown_on_cpu_unless_given(monkeypatch):
    monkeypatch.delenv("DTL_PEAK_TFLOPS", raising=False)
    assert metrics.peak_flops("cpu") is None
    monkeypatch.setenv("DTL_PEAK_TFLOPS", "989")
    assert metrics.peak_flops("cpu") == 989e12


def test_step_logger_writes_log_txt_and_tensorboard_scalars(tmp_path, capsys):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    log = metrics.StepLogger(
        str(tmp_path), 3, tokens_per_step=1000, flops_per_token=6e6, peak_flops_per_device=1e12
    )
    for step in (1, 2, 3):
        log.log(step, loss=4.0 - step, dt_s=0.5)
    log.close()
    printed = capsys.readouterr().out.splitlines()
    assert printed[-1] == "step 3/3 | loss 1.0000 | 500 ms | 2,000 tok/s | mfu 1.2%"
    assert (tmp_path / "log.txt").read_text().splitlines() == printed
    events = glob.glob(str(tmp_path / "tb" / "events.out.tfevents.*"))
    assert len(events) == 1
    acc = EventAccumulator(events[0])
    acc.Reload()
    assert [e.value for e in acc.Scalars("loss/train")] == [3.0, 2.0, 1.0]
    assert acc.Scalars("perf/mfu")[0].value == pytest.approx(0.012)


def test_step_times_reach_the_line_and_tensorboard(tmp_path, capsys):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from dtl.profile import StepTimes

    log = metrics.StepLogger(str(tmp_path), 2, tokens_per_step=100)
    times = StepTimes(step_ms=200, forward_ms=50, backward_ms=90, blocked_ms=20, comm_ms=80,
                      overlap=0.75)  # fmt: skip
    log.log(1, loss=2.0, times=times)
    log.close()
    line = capsys.readouterr().out.splitlines()[-1]
    assert line == (
        "step 1/2 | loss 2.0000 | 200 ms | 500 tok/s | fwd_ms 50 | bwd_ms 90 | blocked_ms 20 | "
        "comm_ms 80 | overlap 75%"
    )
    acc = EventAccumulator(glob.glob(str(tmp_path / "tb" / "events.out.tfevents.*"))[0])
    acc.Reload()
    got = {
        tag: acc.Scalars(tag)[0].value for tag in acc.Tags()["scalars"] if tag.startswith("time/")
    }
    assert got == pytest.approx(
        {
            "time/step_ms": 200,
            "time/forward_ms": 50,
            "time/backward_ms": 90,
            "time/blocked_ms": 20,
            "time/comm_ms": 80,
            "time/overlap": 0.75,
            "time/optimizer_and_rest_ms": 40,
        }
    )


@pytest.mark.parametrize(
    "name, peak",
    [
        ("NVIDIA H100 80GB HBM3", 989e12),
        ("NVIDIA H100 PCIe", 756e12),
        ("NVIDIA H100 NVL", 835e12),
        ("NVIDIA H200", 989e12),
        ("NVIDIA H200 NVL", 835e12),
        ("NVIDIA A100-SXM4-80GB", 312e12),
        ("NVIDIA GeForce RTX 4090", None),
    ],
)
def test_peak_table_matches_device_names_most_specific_first(monkeypatch, name, peak):
    monkeypatch.delenv("DTL_PEAK_TFLOPS", raising=False)
    monkeypatch.setattr(metrics.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(metrics.torch.cuda, "get_device_name", lambda device=None: name)
    assert metrics.peak_flops("cuda:0") == peak


def test_memory_stats_on_cpu_report_the_process_peak_rss():
    stats = metrics.memory_stats("cpu")
    assert list(stats) == ["max_rss_mib"] and 10 < stats["max_rss_mib"] < 24 * 1024
