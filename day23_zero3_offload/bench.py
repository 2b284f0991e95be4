"""Day 23 benchmark: what offload costs, and what each bucket, overlap and aio key does, measured.

CPU (gloo), 2 ranks (a benchmark: the tests run it shrunk on `tiny`):
    torchrun --standalone --nproc_per_node=2 -m day23_zero3_offload.bench --part=templates
    torchrun --standalone --nproc_per_node=2 -m day23_zero3_offload.bench --part=keys
    torchrun --standalone --nproc_per_node=2 -m day23_zero3_offload.bench --part=fit
GPUs: the same with --nproc_per_node=gpu --model=gpt2-124m --seq_len=512 (fp32, as the templates).

templates  every template (and NVMe with the parameters paged: max_in_cpu 0) on the same model
           and batches: median step time and its ratio to no-offload ZeRO-3, bytes per location
           and disk traffic per step, each measured beside predict.py.
keys       one key changed at a time from its template: the median step, the peak of gathered
           parameters (measure.PeakGathered, from every non-persistent parameter's ds_status),
           the persistent and reduce-bucket bytes on the device, the swap buffers in CPU
           memory; what moved, in one table.
fit        the largest GPT of a small grid that a device budget (per rank) fits with each
           template by the explainer; then the largest one for the CPU template really runs a
           step here, and its device bytes (resident + peak gathered) are printed beside the
           budget.
Timings on a shared 2-core box are noisy: read ratios, and the byte columns, which are exact.
"""

from __future__ import annotations

import gc
import os
import re
import statistics
from dataclasses import dataclass
from typing import Literal

from day23_zero3_offload import checks, measure, predict, train
from dtl import config as dtl_config
from dtl import dist as dtl_dist
from dtl import extras
from dtl.deepspeed import use_run_accelerator
from dtl.metrics import write_csv
from dtl.model import PRESETS, PresetName

MB = 1e6
# part=keys: (template, key path, value); the template's own value is the baseline
KEY_SWEEP = [
    ("zero3", "overlap_comm", False),
    ("zero3", "contiguous_gradients", False),
    ("zero3", "reduce_bucket_size", 500_000),
    ("zero3", "stage3_prefetch_bucket_size", 0),
    ("zero3", "stage3_param_persistence_threshold", 0),
    ("zero3", "stage3_param_persistence_threshold", 10_000_000),
    ("zero3", "stage3_max_live_parameters", 100_000),
    ("zero3", "stage3_max_reuse_distance", 0),
    ("nvme", "sub_group_size", 1_000_000),
    ("nvme", "aio.block_size", 4_194_304),
    ("nvme", "aio.queue_depth", 32),
]


@dataclass
class Config:
    part: Literal["templates", "keys", "fit"] = "templates"  # templates | keys | fit
    model: PresetName = "small"  # GPT preset
    seq_len: int = 64  # tokens per sequence
    steps: int = 6  # optimizer steps per run (the first is not timed)
    templates: str = ""  # part=templates: only these, comma-separated (empty: all + nvme_paged)
    keys: str = ""  # part=keys: only these keys, comma-separated (empty: all)
    # part=keys: the model, layers x width of predict.gpt_of (4x256: 12 matrices above the
    # persistence threshold, so the gathering keys have tensors to act on); empty: --model
    keys_model: str = "4x256"
    fit_budget_mb: float = 300.0  # part=fit: device MB per rank (the 200 MB reduce bucket in it)
    nvme_path: str = "/tmp/dtl_nvme_bench"  # the templates' NVMe folder for this benchmark
    out_dir: str = "outputs/day23_zero3_offload/bench"  # <part>.csv

    def validate(self) -> None:
        if self.keys_model and not re.fullmatch(r"\d+x\d+", self.keys_model):
            raise dtl_config.ConfigError(
                f"keys_model must be LAYERSxWIDTH, got {self.keys_model!r}"
            )
        if self.steps < 2:
            raise dtl_config.ConfigError("steps must be >= 2: the first step is not timed")
        if self.seq_len > PRESETS[self.model].block_size:
            raise dtl_config.ConfigError(
                f"seq_len {self.seq_len} exceeds {self.model}'s block_size"
            )
        try:
            checks.check_nvme_path(self.nvme_path)
        except checks.ExplainError as e:
            raise dtl_config.ConfigError(str(e)) from None
        extras.require("day23_zero3_offload.bench", "deepspeed")


def _run_cfg(cfg: Config, template: str, tag: str, model: str | None = None) -> train.Config:
    return train.Config(
        ds_config=template,
        model=model or cfg.model,
        seq_len=cfg.seq_len,
        steps=cfg.steps,
        nvme_path=os.path.join(cfg.nvme_path, tag),
        check=False,
        out_dir=os.path.join(cfg.out_dir, tag),
    )


def _set(ds: dict, path: str, value) -> None:
    node = ds if path.startswith("aio.") else ds["zero_optimization"]
    *parents, leaf = path.removeprefix("aio.").split(".")
    node = ds.setdefault("aio", {}) if path.startswith("aio.") else node
    for p in parents:
        node = node[p]
    node[leaf] = value


def _get(ds: dict, path: str):
    node = ds.get("aio", {}) if path.startswith("aio.") else ds["zero_optimization"]
    return node.get(path.removeprefix("aio."))


def measure_run(cfg: Config, info, rcfg: train.Config, ds: dict) -> dict:
    """One run: median step, bytes by location, disk traffic, peaks; the engine freed after."""
    result = train.run(rcfg, info, ds)
    steady = result["swapped"][1:]
    pred = predict.predict(ds, predict.param_groups(rcfg.model_config()), info.world_size)
    row = dict(
        step_ms=dtl_dist.all_reduce_scalar(statistics.median(result["times"][1:]), average=True)
        * 1e3,
        where=result["where"],
        pred=pred,
        read_mb=statistics.mean(s["read"] for s in steady) / MB,
        write_mb=statistics.mean(s["write"] for s in steady) / MB,
        gathered_mb=result["where"]["device"]["gathered"] / MB,
        reduce_mb=measure.reduce_buffer_bytes(result["engine"]) / MB,
    )
    del result
    gc.collect()
    return row


def nvme_missing() -> str | None:
    """Why the NVMe template cannot run on this machine (no libaio), or None."""
    try:
        checks.check_libaio()
    except checks.MissingLibaio as e:
        return str(e)
    return None


def _runnable(names: list[str], templates: list[str], not_run: list[str]) -> list[bool]:
    """Which entries may run here: NVMe ones only with libaio (each one left out is said)."""
    reason = nvme_missing() if "nvme" in templates else None
    keep = [t != "nvme" or reason is None for t in templates]
    for name, ok in zip(names, keep):
        if not ok:
            not_run.append(name)
            dtl_dist.print0(f"{name}: not run here: {reason}")
    return keep


def run_templates(cfg: Config, info, not_run: list[str]) -> list[dict]:
    rows = []
    variants = [(t, t, None) for t in checks.TEMPLATES] + [("nvme", "nvme_paged", 0)]
    wanted = {t for t in cfg.templates.split(",") if t}
    variants = [v for v in variants if not wanted or v[1] in wanted]
    keep = _runnable([v[1] for v in variants], [v[0] for v in variants], not_run)
    variants = [v for v, ok in zip(variants, keep) if ok]
    for template, tag, max_in_cpu in variants:
        rcfg = _run_cfg(cfg, template, tag)
        ds = rcfg.load_ds_config()
        if max_in_cpu is not None:
            ds["zero_optimization"]["offload_param"]["max_in_cpu"] = max_in_cpu
        r = measure_run(cfg, info, rcfg, ds)
        got, want = predict.totals(r["where"]), predict.totals(r["pred"])
        rows.append(
            dict(
                template=tag,
                step_ms=r["step_ms"],
                **{f"{loc}_mb": got[loc] / MB for loc in predict.LOCATIONS},
                **{f"{loc}_pred_mb": want[loc] / MB for loc in predict.LOCATIONS},
                read_mb=r["read_mb"],
                read_pred_mb=r["pred"]["disk"]["read"] / MB,
                write_mb=r["write_mb"],
                write_pred_mb=r["pred"]["disk"]["write"] / MB,
            )
        )
        dtl_dist.print0(f"{tag}: {r['step_ms']:.0f} ms per step")
    base = rows[0]["step_ms"]
    for r in rows:
        r["ratio"] = r["step_ms"] / base
    dtl_dist.print0(
        f"{'template':<12}{'step ms':>9}{'x zero3':>9}{'device MB':>11}{'(pred)':>9}{'CPU MB':>9}"
        f"{'(pred)':>9}{'NVMe MB':>9}{'(pred)':>8}{'read MB':>9}{'(pred)':>8}{'write MB':>9}"
        f"{'(pred)':>8}"
    )
    for r in rows:
        dtl_dist.print0(
            f"{r['template']:<12}{r['step_ms']:>9.0f}{r['ratio']:>9.2f}{r['device_mb']:>11.2f}"
            f"{r['device_pred_mb']:>9.2f}{r['cpu_mb']:>9.2f}{r['cpu_pred_mb']:>9.2f}"
            f"{r['nvme_mb']:>9.2f}{r['nvme_pred_mb']:>8.2f}{r['read_mb']:>9.2f}"
            f"{r['read_pred_mb']:>8.2f}{r['write_mb']:>9.2f}{r['write_pred_mb']:>8.2f}"
        )
    return rows


def _keys_cfg(cfg: Config, template: str, tag: str) -> train.Config:
    rcfg = _run_cfg(cfg, template, tag)
    if cfg.keys_model:
        layers, width = (int(v) for v in cfg.keys_model.split("x"))
        model = predict.gpt_of(layers, width)
        rcfg.model_config = lambda: model  # a grid model, not a preset
    return rcfg


def run_keys(cfg: Config, info, not_run: list[str]) -> list[dict]:
    wanted = {k for k in cfg.keys.split(",") if k}
    sweep = [s for s in KEY_SWEEP if not wanted or s[1] in wanted]
    keep = _runnable([f"{t} {k}" for t, k, _ in sweep], [t for t, _, _ in sweep], not_run)
    sweep = [s for s, ok in zip(sweep, keep) if ok]
    baselines, rows = {}, []
    for template, key, value in sweep:
        if template not in baselines:
            rcfg = _keys_cfg(cfg, template, f"keys-{template}")
            baselines[template] = measure_run(cfg, info, rcfg, rcfg.load_ds_config())
        rcfg = _keys_cfg(cfg, template, f"keys-{template}-{key}")
        ds = rcfg.load_ds_config()
        before = _get(ds, key)
        _set(ds, key, value)
        r, b = measure_run(cfg, info, rcfg, ds), baselines[template]
        row = dict(
            template=template,
            key=key,
            base=before,
            value=value,
            step_ms=r["step_ms"],
            base_ms=b["step_ms"],
            ratio=r["step_ms"] / b["step_ms"],
        )
        for name, get in _KEY_BYTES.items():
            row[name], row[f"base_{name}"] = get(r), get(b)
        rows.append(row)
        dtl_dist.print0(f"{template} {key}: {before} -> {value}: {r['step_ms']:.0f} ms")
    dtl_dist.print0(
        f"{'template':<9}{'key':<37}{'value':>22}{'step x':>8}{'gathered MB':>13}"
        f"{'persist MB':>12}{'reduce MB':>13}{'buffers MB':>16}"
    )
    for r in rows:
        cells = "".join(
            f"{_pair(r[f'base_{k}'], r[k]):>{w}}"
            for k, w in (("gathered", 13), ("persistent", 12), ("reduce", 13), ("buffers", 16))
        )
        change = f"{r['base']} -> {r['value']}"
        dtl_dist.print0(f"{r['template']:<9}{r['key']:<37}{change:>22}{r['ratio']:>8.2f}{cells}")
    return rows


_KEY_BYTES = {  # the byte columns of part=keys: MB, this rank
    "gathered": lambda r: r["gathered_mb"],
    "persistent": lambda r: r["where"]["device"]["persistent"] / MB,
    "reduce": lambda r: r["reduce_mb"],
    "buffers": lambda r: r["where"]["cpu"]["buffers"] / MB,  # pinned swap buffers
}


def _pair(before: float, after: float) -> str:
    return f"{before:.1f}" if abs(after - before) < 0.05 else f"{before:.1f}->{after:.1f}"


FIT_WIDTHS = (64, 128, 192, 256, 384, 512)
FIT_DEPTHS = (2, 4, 6, 8, 12)


def run_fit(cfg: Config, info, not_run: list[str]) -> list[dict]:
    budget = cfg.fit_budget_mb * MB
    rows = []
    for name in checks.TEMPLATES:
        ds = checks.read(checks.template_path(name))
        best = predict.largest_fit(  # a grid this machine can run
            ds, info.world_size, budget, cpu_budget=8e9, widths=FIT_WIDTHS, depths=FIT_DEPTHS
        )
        n = sum(map(sum, predict.groups_by_formula(best))) if best else 0
        rows.append(
            dict(
                template=name,
                n_layer=best.n_layer if best else 0,
                n_embd=best.n_embd if best else 0,
                params=n,
            )
        )
        dtl_dist.print0(
            f"{name}: largest fitting {budget / MB:.0f} MB per rank: "
            f"{best.n_layer} x {best.n_embd} ({n / 1e6:.1f} M parameters)"
            if best
            else f"{name}: none of the grid fits {budget / MB:.0f} MB per rank"
        )
    cpu_row = next(r for r in rows if r["template"] == "cpu")
    run = _run_largest(cfg, info, cpu_row)
    cpu_row.update(run)
    dtl_dist.print0(
        f"ran it (cpu template, {cpu_row['n_layer']} x {cpu_row['n_embd']}): device bytes per "
        f"rank {run['device_mb']:.1f} MB (persistent, peak gathered, reduce bucket) vs the "
        f"budget {budget / MB:.0f} MB "
        f"({'fits' if run['device_mb'] <= budget / MB else 'DOES NOT FIT'})"
    )
    return rows


def _run_largest(cfg: Config, info, row: dict) -> dict:
    model = predict.gpt_of(row["n_layer"], row["n_embd"])  # the grid's model, not a preset
    rcfg = _run_cfg(cfg, "cpu", "fit", model="small")
    rcfg.steps = 2
    rcfg.model_config = lambda: model
    r = measure_run(cfg, info, rcfg, rcfg.load_ds_config())
    return dict(device_mb=predict.totals(r["where"])["device"] / MB)


def main(argv: list[str] | None = None) -> None:
    cfg = dtl_config.parse(Config, argv)
    info = dtl_dist.init()
    use_run_accelerator(info.device.type)  # before anything below imports DeepSpeed
    dtl_config.save(cfg, cfg.out_dir, argv)
    not_run: list[str] = []  # NVMe entries on a machine without libaio
    part = {"templates": run_templates, "keys": run_keys, "fit": run_fit}[cfg.part]
    rows = part(cfg, info, not_run)
    if not rows:  # nothing this machine can run: SKIP, with the reason, never PASS
        dtl_dist.print0(f"skipped: {nvme_missing()}")
        dtl_dist.cleanup()
        return
    absent = f"; not run here: {', '.join(not_run)} (no libaio)" if not_run else ""
    if info.is_main:
        flat = [{k: v for k, v in r.items() if not isinstance(v, dict)} for r in rows]
        write_csv(flat, os.path.join(cfg.out_dir, f"{cfg.part}.csv"))
    if cfg.part == "templates":
        worst = max(
            abs(r[f"{loc}_mb"] - r[f"{loc}_pred_mb"]) / r[f"{loc}_pred_mb"]
            for r in rows
            for loc in predict.LOCATIONS
            if r[f"{loc}_pred_mb"]
        )
        slowest = max(rows, key=lambda r: r["ratio"])
        dtl_dist.print0(
            f"summary: day23 bench templates on {cfg.model}: bytes per location = prediction "
            f"within {worst:.1%}; slowest {slowest['template']} at {slowest['ratio']:.2f}x "
            f"no-offload ZeRO-3{absent}"
        )
    elif cfg.part == "keys":
        model = cfg.keys_model or cfg.model
        dtl_dist.print0(
            f"summary: day23 bench keys: {len(rows)} changes measured on {model}{absent}"
        )
    else:
        fit = next(r for r in rows if r["template"] == "cpu")
        ok = fit["device_mb"] <= cfg.fit_budget_mb
        dtl_dist.print0(
            f"summary: day23 bench fit: the cpu template's largest model "
            f"({fit['params'] / 1e6:.1f} M) ran within {cfg.fit_budget_mb:.0f} MB per rank: "
            f"{'yes' if ok else 'NO'}"
        )
    dtl_dist.cleanup()


if __name__ == "__main__":
    main()
