"""Does PyTorch's cuDNN attention op take GQA's K/V heads as they are? (issue 55, GQA rows)

The cuDNN adapter (``kernels/torch_cuda.py``) expands K/V to the query heads before
``aten::_scaled_dot_product_cudnn_attention`` and sums dK / dV back over each group: at
P8 C2 GQA 32/8, 128K tokens, 4.29 GB of adapter copies and 3.22 GB of sums per layer
(``benchmarks/results/layer_traffic.md``). The SDPA dispatcher checks equal heads before it
picks cuDNN; whether the op itself, called directly, is right with fewer K/V heads only a GPU
shows. This calls it both ways, forward and backward, on the schedule's layout (``[s, b, h, d]``
storage seen as ``[b, h, s, d]``) and on contiguous tensors, against a float64 reference, and
times both ways (median of 5 CUDA-event timings after a warm-up).

    python -m benchmarks.gpu.probe_cudnn_gqa            # on a GPU: a table on stdout
    python -m benchmarks.gpu.probe_cudnn_gqa --cpu-selfcheck   # the harness, math SDPA standing in
"""

from __future__ import annotations

import argparse
import statistics

import torch
import torch.nn.functional as F

from megatron_startrail.kernels.reference import expand_kv_heads, sum_kv_head_groups

_aten = torch.ops.aten


def _cudnn(q, k, v, dout, causal):
    """Forward + backward through the aten ops, K/V as given; returns out, dq, dk, dv."""
    res = _aten._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.0, causal, False, scale=None)
    out, lse = res[0], res[1]
    empty = torch.empty((), dtype=torch.int64, device=q.device)
    dout = torch.empty_like(out).copy_(dout)  # dO in out's layout (the adapter's rule)
    dq, dk, dv = _aten._scaled_dot_product_cudnn_attention_backward(
        dout, q, k, v, out, lse.contiguous(), empty, empty, None, None, None, q.shape[2], k.shape[2], 0.0, causal,
        scale=None)
    return out, dq, dk, dv


def _stand_in(q, k, v, dout, causal):
    """CPU self-check: math SDPA with enable_gqa, autograd for the gradients."""
    q, k, v = (x.detach().requires_grad_(True) for x in (q, k, v))
    out = F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)
    out.backward(dout)
    return out.detach(), q.grad, k.grad, v.grad


def _reference(q, k, v, dout, causal):
    q, k, v = (x.detach().double().requires_grad_(True) for x in (q, k, v))
    h = q.shape[1]
    out = F.scaled_dot_product_attention(q, expand_kv_heads(k, h), expand_kv_heads(v, h), is_causal=causal)
    out.backward(dout.double())
    return out.detach(), q.grad, k.grad, v.grad


def _inputs(b, s, hq, hkv, d, dtype, device, layout, seed):
    gen = torch.Generator(device="cpu").manual_seed(seed)

    def one(h):
        x = torch.randn(s, b, h, d, generator=gen).to(device=device, dtype=dtype)  # [s, b, h, d] storage
        return x.permute(1, 2, 0, 3) if layout == "sbhd" else x.permute(1, 2, 0, 3).contiguous()

    return one(hq), one(hkv), one(hkv), one(hq).transpose(1, 2).contiguous().transpose(1, 2)


def _error(got, want):
    return float((got.double() - want).abs().max() / want.abs().max())


def _time(fn, device, reps=5):
    fn()
    if device != "cuda":
        return float("nan")
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def run(device: str, dtype: torch.dtype, sizes, call) -> list[str]:
    # errors: max |error| / max |reference|; the reference is float64 up to 2048 tokens, the expanded way beyond
    rows = ["| b x s | heads q/kv | layout | causal | way | out err | dq err | dk err | dv err | fwd+bwd ms |",
            "|---|---|---|---|---|---|---|---|---|---|"]
    for b, s, hq, hkv, d in sizes:
        for layout in ("sbhd", "contiguous"):
            for causal in (False, True):
                q, k, v, dout = _inputs(b, s, hq, hkv, d, dtype, device, layout, seed=s + hq + causal)
                if s <= 2048:  # float64 on the host; longer: against the expanded way (the adapter's, PASS on GPUs)
                    want = _reference(q.cpu(), k.cpu(), v.cpu(), dout.cpu(), causal)
                else:
                    want = [x.double().cpu() for x in _expanded(call, q, k, v, dout, causal)]
                ways = {
                    "K/V as they are": lambda: call(q, k, v, dout, causal),
                    "K/V expanded, dK/dV summed": lambda: _expanded(call, q, k, v, dout, causal),
                }
                for way, fn in ways.items():
                    try:
                        got = fn()
                        errs = [f"{_error(g.cpu(), w):.1e}" for g, w in zip(got, want)]
                        ms = f"{_time(fn, device):.3f}"
                    except Exception as e:  # noqa: BLE001 - the op's refusal is a result here
                        errs, ms = [f"refused: {type(e).__name__}: {str(e).splitlines()[0][:120]}", "", "", ""], ""
                    rows.append(f"| {b} x {s} | {hq}/{hkv} | {layout} | {causal} | {way} | " + " | ".join(errs)
                                + f" | {ms} |")
    return rows


def _expanded(call, q, k, v, dout, causal):
    """The adapter's way before it took GQA heads as they are: K/V expanded to the query heads
    (``kernels.reference.expand_kv_heads``), dK / dV summed back over each group."""
    h, hkv = q.shape[1], k.shape[1]
    out, dq, dk, dv = call(q, expand_kv_heads(k, h), expand_kv_heads(v, h), dout, causal)
    return out, dq, sum_kv_head_groups(dk, hkv), sum_kv_head_groups(dv, hkv)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cpu-selfcheck", action="store_true", help="the harness on the CPU, math SDPA standing in")
    args = p.parse_args(argv)
    if args.cpu_selfcheck:
        rows = run("cpu", torch.float32, [(2, 64, 8, 2, 16), (1, 2080, 4, 2, 8)], _stand_in)
    else:
        assert torch.cuda.is_available(), "a GPU run: use --cpu-selfcheck on the CPU"
        print(torch.cuda.get_device_name(), torch.__version__, "cuDNN", torch.backends.cudnn.version())
        rows = run("cuda", torch.bfloat16, [(2, 1024, 32, 8, 128), (1, 8192, 32, 8, 128), (1, 8192, 16, 16, 128)],
                   _cudnn)
    print("\n".join(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
