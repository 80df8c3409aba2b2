"""The benchmark's PyTorch ring-attention peer is exact (so its timings are of real work)."""

import itertools

import torch
import torch.distributed as dist

from benchmarks.testbed.torch_cp_peer import ROTATE_METHODS, torch_ring_attn
from tests.attention_cases import TOLERANCE, full_inputs, local_rows, reference_with_grads, relative_error
from tests.multiproc import run_ranks

BATCH, HEADS, DIM, CHUNK = 2, 2, 8, 5


def worker(rank, world_size):
    torch.use_deterministic_algorithms(True)
    torch.utils.deterministic.fill_uninitialized_memory = True  # NaN-poisoned empty buffers
    seq, scale = 2 * world_size * CHUNK, DIM**-0.5
    full = full_inputs(7, seq, BATCH, HEADS, HEADS, DIM, torch.float32)
    errors = {}
    for causal, method in itertools.product((True, False), ROTATE_METHODS):
        ref = reference_with_grads(*full, causal, scale)
        q, k, v, dout = (local_rows(t, rank, world_size).float() for t in full)
        q, k, v = (t.requires_grad_(True) for t in (q, k, v))
        out = torch_ring_attn(q, k, v, dist.group.WORLD, causal=causal, softmax_scale=scale, rotate_method=method)
        out.backward(dout)
        for name, got, want in zip(("out", "dq", "dk", "dv"), (out.detach(), q.grad, k.grad, v.grad), ref):
            errors[causal, method, name] = relative_error(got, local_rows(want, rank, world_size))
    return errors


def test_torch_ring_peer_matches_float64():
    for errors in run_ranks(worker, 4):
        for key, err in errors.items():
            assert err < TOLERANCE[torch.float32], (key, err)
