"""The torch backend's decode step alone, in-process (no HTTP, no scheduler): where a step's time goes.

For ``random:0.6b`` in bf16 on one GPU, with every sequence 640 tokens long, per batch size: the
median milliseconds of the pooled step replayed as a CUDA graph (its elementwise chains as they are,
and fused by inductor: ``compileDecode``), the same step eager, and the
per-sequence eager step it replaced (:func:`~drs_engine.backends.torch.model.decode_step`), each
after warm-up, timed with CUDA events over ``STEPS`` steps, median and spread of ``ROUNDS``
rounds; the first step's seconds (a capture, and the compile for the first batch size), and each
variant's logits against the eager step's (largest difference, equal greedy picks). Beside them the memory floor: weight bytes plus the batch's KV bytes over the measured
device-copy rate. Prints one JSON line. Needs a CUDA GPU.
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from drs_engine.backends.torch.decoder import BatchDecoder
from drs_engine.backends.torch.model import SIZES, decode_step, new_kv, random_state_dict
from drs_protocol.enums import SlotAttention

LENGTH = 640
STEPS = 20
ROUNDS = 5
#: (result key, CUDA graphs, elementwise chains compiled by inductor, weights packed as the engine
#: holds them: q/k/v and gate/up multiplied at once, ``pooled.fuse_projections``, the attention:
#: ``slotAttention`` sdpa or flex)
VARIANTS = (
    ("pooled_eager_ms", False, False, False, "sdpa"),
    ("pooled_graph_ms", True, False, False, "sdpa"),
    ("pooled_graph_compiled_ms", True, True, False, "sdpa"),
    ("pooled_graph_compiled_packed_ms", True, True, True, "sdpa"),
    ("pooled_graph_compiled_packed_flex_ms", True, True, True, "flex"),
)


def _ms(fn: Any) -> dict[str, float]:
    for _ in range(3):
        fn()
    times = []
    for _ in range(ROUNDS):
        began, ended = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        began.record()
        for _ in range(STEPS):
            fn()
        ended.record()
        ended.synchronize()
        times.append(began.elapsed_time(ended) / STEPS)
    return {"median": round(statistics.median(times), 3), "min": round(min(times), 3), "max": round(max(times), 3)}


def _copy_gbps() -> float:
    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    dst.copy_(src)
    began, ended = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    began.record()
    for _ in range(10):
        dst.copy_(src)
    ended.record()
    ended.synchronize()
    return float(2 * 10 * (1 << 30) / (began.elapsed_time(ended) / 1000) / 1e9)


def _seated(
    shape: Any, kvs: list[Any], greedy: Any, *, graphs: bool, compiled: bool, attention: str
) -> tuple[BatchDecoder, list[Any]]:
    """A decode pool as the engine makes it (64 slots of 2,048 tokens, bf16) with ``kvs`` seated,
    each a sequence of :data:`LENGTH` tokens."""
    from drs_engine.backends.torch.batching import DecodeSeq

    decoder = BatchDecoder(
        shape,
        slots=64,
        slot_tokens=2048,
        cuda_graphs=graphs,
        compiled=compiled,
        device=torch.device("cuda:0"),
        dtype=torch.bfloat16,
        attention=SlotAttention(attention),
    )
    seqs = [
        DecodeSeq(kv, LENGTH, 1000 + j, greedy, [0], lambda _: (None, None), lambda _: None) for j, kv in enumerate(kvs)
    ]
    decoder.seat(seqs)
    return decoder, seqs


def profile(batches: tuple[int, ...], out: Path, attention: str = "sdpa") -> dict[str, Any]:
    """Where a served decode step's time goes: per batch size, the compiled pooled step run eagerly
    (every kernel visible; with CUDA graphs a replay shows as one launch) and the batch's token
    choice (:func:`~drs_engine.backends.torch.sampling.choose_tokens`, greedy, the host sync), under
    ``torch.profiler`` over ``STEPS`` steps: each batch's table by device time into ``out``, and the
    graph-replayed step with the choice timed by CUDA events (what the batcher's job costs)."""
    from drs_engine.backends.torch.sampling import BanMasks, Sampling, choose_tokens
    from drs_engine.backends.torch.weights.packed import pack
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    shape, device, dtype = SIZES["0.6b"], torch.device("cuda:0"), torch.bfloat16
    params = pack(random_state_dict(shape, seed=0, device=device, dtype=dtype), device).params  # as served
    greedy = Sampling(temperature=0.0, top_p=1.0, top_k=0, logprobs=False, top_logprobs=0)
    bans = BanMasks(shape.vocab_size, vocab_limit=None, eos_token_id=151645, device=device)
    out.mkdir(parents=True, exist_ok=True)
    result: dict[str, Any] = {}
    for batch in batches:
        kvs = [new_kv(shape, LENGTH + 1, device=device, dtype=dtype).normal_() for _ in range(batch)]
        row: dict[str, Any] = {}
        for graphs in (False, True):
            decoder, seqs = _seated(shape, kvs, greedy, graphs=graphs, compiled=True, attention=attention)
            mask = bans.mask(produced=1, min_tokens=0)

            def job(d: Any = decoder, s: Any = seqs, m: Any = mask) -> Any:
                return choose_tokens(d.step(params, "w", s), [greedy] * len(s), [m] * len(s))

            if graphs:
                row["graph_step_ms"] = _ms(lambda d=decoder, s=seqs: d.step(params, "w", s))
                row["graph_step_and_choice_ms"] = _ms(job)
            else:
                for _ in range(3):
                    job()
                torch.cuda.synchronize()
                with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                    for _ in range(STEPS):
                        job()
                    torch.cuda.synchronize()
                table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=40)
                (out / f"decode_profile_{attention}_b{batch}.txt").write_text(table)
                print(table, file=sys.stderr, flush=True)
            decoder.free()
        result[str(batch)] = row
    return result


def main(batches: tuple[int, ...] = (1, 8, 32, 64), per_sequence: bool = True) -> dict[str, Any]:
    from drs_engine.backends.torch.sampling import Sampling

    shape, device, dtype = SIZES["0.6b"], torch.device("cuda:0"), torch.bfloat16
    from drs_engine.backends.torch.weights.packed import pack

    loose = random_state_dict(shape, seed=0, device=device, dtype=dtype)
    packed = pack(loose, device).params
    weight_bytes = sum(t.numel() * t.element_size() for t in loose.values())
    gbps = _copy_gbps()
    greedy = Sampling(temperature=0.0, top_p=1.0, top_k=0, logprobs=False, top_logprobs=0)
    out: dict[str, Any] = {}
    for batch in batches:
        row: dict[str, Any] = {}
        kvs = [new_kv(shape, LENGTH + 1, device=device, dtype=dtype).normal_() for _ in range(batch)]
        logits: dict[str, Any] = {}
        for name, graphs, compiled, is_packed, attention in VARIANTS:
            params = packed if is_packed else loose
            decoder, seqs = _seated(shape, kvs, greedy, graphs=graphs, compiled=compiled, attention=attention)
            began = time.monotonic()
            logits[name] = decoder.step(params, "w", seqs).clone()
            row[name.replace("_ms", "_first_step_s")] = round(time.monotonic() - began, 2)
            row[name] = _ms(lambda d=decoder, s=seqs, p=params: d.step(p, "w", s))
            decoder.free()
        base = logits["pooled_eager_ms"]
        row["max_abs_logit_diff"] = {k: round(float((v - base).abs().max()), 4) for k, v in logits.items()}
        row["argmax_equal"] = {k: bool(torch.equal(v.argmax(-1), base.argmax(-1))) for k, v in logits.items()}
        if per_sequence:
            row["per_sequence_eager_ms"] = _ms(
                lambda b=batch, k=kvs, p=params: decode_step(p, shape, [1000] * b, k, [LENGTH] * b)
            )
        kv_bytes = batch * LENGTH * shape.kv_bytes_per_token(dtype)
        floor_ms = (weight_bytes + kv_bytes) / (gbps * 1e9) * 1000
        row["memory_floor_ms"] = round(floor_ms, 3)
        row["graph_over_floor"] = round(row["pooled_graph_ms"]["median"] / floor_ms, 2)
        row["compiled_over_floor"] = round(row["pooled_graph_compiled_ms"]["median"] / floor_ms, 2)
        row["compiled_over_graph"] = round(
            row["pooled_graph_compiled_ms"]["median"] / row["pooled_graph_ms"]["median"], 3
        )
        row["flex_over_sdpa"] = round(
            row["pooled_graph_compiled_packed_flex_ms"]["median"] / row["pooled_graph_compiled_packed_ms"]["median"], 3
        )
        row["compiled_tok_s"] = round(batch * 1000 / row["pooled_graph_compiled_ms"]["median"], 1)
        row["packed_over_compiled"] = round(
            row["pooled_graph_compiled_packed_ms"]["median"] / row["pooled_graph_compiled_ms"]["median"], 3
        )
        out[str(batch)] = row
        print(json.dumps({str(batch): row}), file=sys.stderr, flush=True)  # progress
        torch.cuda.empty_cache()
    return {
        "bench": "decode_step",
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%MZ"),
        "gpu": torch.cuda.get_device_name(0),
        "torch": torch.__version__,
        "model": "random:0.6b bfloat16",
        "length": LENGTH,
        "copy_gbps": round(gbps, 1),
        "weight_bytes": weight_bytes,
        "batches": out,
    }


if __name__ == "__main__":
    cli = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    cli.add_argument("--batches", default="1,8,32,64", help="comma-separated batch sizes")
    cli.add_argument("--no-per-sequence", action="store_true", help="skip the per-sequence eager step")
    cli.add_argument("--profile", metavar="DIR", help="only profile the served step (tables into DIR)")
    cli.add_argument("--attention", default="sdpa", choices=["sdpa", "flex"], help="the profiled step's attention")
    args = cli.parse_args()
    if args.profile:
        batches = tuple(int(b) for b in args.batches.split(","))
        print(
            json.dumps(
                {"bench": "decode_step --profile", "batches": profile(batches, Path(args.profile), args.attention)}
            )
        )
        sys.exit(0)
    print(json.dumps(main(tuple(int(b) for b in args.batches.split(",")), not args.no_per_sequence)), flush=True)
