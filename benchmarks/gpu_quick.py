"""A first GPU timing of this library alone against the lm_head GEMM floor (bf16, dapo, forward + backward).

python -m benchmarks.gpu_quick [--tokens 8192] [--hidden 4096] [--vocab 151936]
"""

from __future__ import annotations

import argparse

import torch

from compiled_grpo import FusedLinearGRPOLoss


def cuda_median_ms(fn, repeats=10, warmup=3):
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--vocab", type=int, default=151936)
    a = ap.parse_args(argv)
    dev, dt = "cuda", torch.bfloat16
    hidden = torch.randn(a.batch, a.seq, a.hidden, device=dev, dtype=dt) / a.hidden**0.25
    weight = (torch.randn(a.vocab, a.hidden, device=dev, dtype=dt) / a.hidden**0.5).requires_grad_()
    ids = torch.randint(0, a.vocab, (a.batch, a.seq), device=dev)
    mask = torch.ones(a.batch, a.seq, device=dev, dtype=torch.long)
    adv = torch.randn(a.batch, device=dev)
    x = hidden.reshape(-1, a.hidden)

    def floor():
        z = x @ weight.T
        _ = z @ weight
        _ = z.T @ x

    def fused(loss_fn):
        def run():
            h = hidden.detach().requires_grad_()
            weight.grad = None
            loss_fn(h, weight, ids, mask, adv).loss.backward()

        return run

    base = torch.cuda.memory_allocated()
    rows = [("three GEMMs (floor)", floor)]
    for schedule in ("speed", "memory"):
        for compiled in (False, True):
            loss_fn = FusedLinearGRPOLoss(compiled=compiled, schedule=schedule, validate=False)
            rows.append((f"{schedule}, {'compiled' if compiled else 'eager'}", fused(loss_fn)))
    q = FusedLinearGRPOLoss(compiled=True, schedule="memory", top_entropy_quantile=0.2, validate=False)
    rows.append(("memory, compiled, q=0.2", fused(q)))
    floor_ms = None
    gpu = torch.cuda.get_device_name()
    print(f"B={a.batch} T={a.seq} H={a.hidden} V={a.vocab} bf16 on {gpu}, torch {torch.__version__}")
    for name, fn in rows:
        torch.cuda.reset_peak_memory_stats()
        ms = cuda_median_ms(fn)
        peak = (torch.cuda.max_memory_allocated() - base) / 2**30
        floor_ms = floor_ms or ms
        print(f"{name:28s} {ms:8.1f} ms  {ms / floor_ms:5.2f}x floor  peak +{peak:5.2f} GiB", flush=True)


if __name__ == "__main__":
    main()
