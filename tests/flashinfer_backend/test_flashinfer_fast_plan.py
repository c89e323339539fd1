"""The decode re-planner (attnbackends.ops.flashinfer.fast_plan) on the CPU: when it applies, and what it hands FlashInfer's
scheduler and run() for a batch, on a stand-in wrapper with flashinfer 0.6.13's fields. That these are exactly what
``plan()`` would produce is checked on the GPU against the real wrapper, bit for bit
(test_flashinfer_gpu.py::test_replanned_decode_equals_plan_bit_for_bit)."""

from types import SimpleNamespace

import pytest
import torch

from attnbackends.ops.flashinfer.fast_plan import DecodeReplanner, replan_unsupported_reason
from attnbackends.ops.flashinfer.plan_inputs import DevicePlanBuffer, paged_kv_plan_inputs
from attnbackends.metadata import build_common_metadata


class RecordingModule:
    def __init__(self):
        self.calls = []

    def plan(self, *args):
        self.calls.append(args)
        return [len(self.calls), 7]


def stand_in_wrapper(*, tensor_cores=True, backend="fa2", cuda_graph=False, batch=3, pages=64):
    w = SimpleNamespace(
        _cached_module=RecordingModule(), _plan_info=None, _jit_module=None, _backend=backend,
        _float_workspace_buffer=torch.zeros(16, dtype=torch.uint8), _int_workspace_buffer=torch.zeros(8),
        _pin_memory_int_workspace_buffer=torch.zeros(8), _use_tensor_cores=tensor_cores, _use_cuda_graph=cuda_graph,
        _paged_kv_indptr_buf=None, _paged_kv_indices_buf=None, _paged_kv_last_page_len_buf=None,
    )
    if cuda_graph:
        w._fixed_batch_size = batch
        w._paged_kv_indptr_buf = torch.zeros(batch + 1, dtype=torch.int32)
        w._paged_kv_indices_buf = torch.zeros(pages, dtype=torch.int32)
        w._paged_kv_last_page_len_buf = torch.zeros(batch, dtype=torch.int32)
    return w


def replanner(wrapper, **overrides):
    kw = dict(num_qo_heads=8, num_kv_heads=2, head_dim=64, page_size=16, window_left=-1, logits_soft_cap=None,
              q_dtype=torch.float16, kv_dtype=torch.float16)
    return DecodeReplanner(wrapper, **{**kw, **overrides})


def decode_inputs(staged=True):
    """KV lengths 4, 17, 33 at page size 16: 1, 2, 3 pages; staged in a device buffer (here on the CPU), whose
    storage is poisoned first."""
    common = build_common_metadata([1, 1, 1], [3, 16, 32], [[7], [2, 9], [4, 5, 6]], 16)
    device_buffer = DevicePlanBuffer("cpu", initial_elements=64) if staged else None
    if staged:
        device_buffer._buffer.fill_(-77)
    inputs = paged_kv_plan_inputs(common.query_start_loc_cpu, common.seq_lens_cpu, common.block_table, 16,
                                  device_buffer=device_buffer)
    return common, inputs


def test_reasons():
    w = stand_in_wrapper()
    assert replan_unsupported_reason("0.6.13", w) is None
    assert "not one of the tested versions" in replan_unsupported_reason("0.7.0", w)
    assert "JIT" in replan_unsupported_reason("0.6.13", SimpleNamespace(**{**vars(w), "_jit_module": object()}))
    assert "trtllm-gen" in replan_unsupported_reason("0.6.13", stand_in_wrapper(backend="trtllm-gen"))
    assert replan_unsupported_reason("0.6.13", stand_in_wrapper(tensor_cores=False, backend="auto")) is None
    partial = SimpleNamespace(**{k: v for k, v in vars(w).items() if k != "_cached_module"})
    assert "_cached_module" in replan_unsupported_reason("0.6.13", partial)


@pytest.mark.parametrize("backend, tail", [("fa2", (-1, False, 0)), ("fa3", ())])
def test_tensor_core_replan(backend, tail):
    common, inputs = decode_inputs()
    w = stand_in_wrapper(backend=backend)
    replanner(w, window_left=10).replan(inputs, 3, common.seq_lens_cpu)
    (args,) = w._cached_module.calls
    ws = (w._float_workspace_buffer, w._int_workspace_buffer, w._pin_memory_int_workspace_buffer)
    assert all(a is b for a, b in zip(args[:3], ws))
    qo, indptr, kv_lens = (t.tolist() for t in args[3:6])
    assert (qo, indptr, kv_lens) == ([0, 1, 2, 3], [0, 1, 3, 6], [4, 17, 33])
    assert args[6:] == (3, 3, 8, 2, 16, False, 64, 64, False, 10) + tail
    assert w._plan_info == [1, 7] and w._batch_size == 3 and w._max_kv_len == 33 and w._block_tables is None
    assert w._paged_kv_indptr_buf.tolist() == [0, 1, 3, 6]
    assert w._paged_kv_indices_buf.tolist() == [7, 2, 9, 4, 5, 6]
    assert w._paged_kv_last_page_len_buf.tolist() == [4, 1, 1]
    assert w._qo_indptr_buf.tolist() == [0, 1, 2, 3]
    # run() reads the staged device arrays, not host copies
    staged = inputs.on_device
    for name, t in (("_paged_kv_indptr_buf", staged.kv_indptr), ("_paged_kv_indices_buf", staged.kv_indices),
                    ("_paged_kv_last_page_len_buf", staged.kv_last_page_len), ("_qo_indptr_buf", staged.qo_indptr)):
        assert getattr(w, name) is t, name


def test_plain_replan_needs_the_staged_arrays():
    common, inputs = decode_inputs(staged=False)
    with pytest.raises(ValueError, match="device_buffer"):
        replanner(stand_in_wrapper()).replan(inputs, 3, common.seq_lens_cpu)


def test_cuda_core_replan_passes_soft_cap_and_dtypes():
    common, inputs = decode_inputs()
    w = stand_in_wrapper(tensor_cores=False, backend="auto")
    replanner(w, logits_soft_cap=30.0, kv_dtype=torch.float8_e4m3fn).replan(inputs, 2, common.seq_lens_cpu)
    (args,) = w._cached_module.calls
    assert args[3].tolist() == [0, 1, 3]
    assert args[4:12] == (2, 8, 2, 16, False, -1, 30.0, 64) and args[12] == 64
    assert args[13].dtype == torch.float16 and args[14].dtype == torch.float8_e4m3fn
    assert w._paged_kv_indptr_buf.tolist() == [0, 1, 3] and w._paged_kv_last_page_len_buf.tolist() == [4, 1]
    assert w._paged_kv_indices_buf.tolist() == [7, 2, 9]


@pytest.mark.parametrize("staged", [True, False])
def test_cuda_graph_replan_fills_the_persistent_buffers(staged):
    common, inputs = decode_inputs(staged)
    w = stand_in_wrapper(cuda_graph=True, batch=3, pages=8)
    buffers = (w._paged_kv_indptr_buf, w._paged_kv_indices_buf, w._paged_kv_last_page_len_buf)
    replanner(w).replan(inputs, 3, common.seq_lens_cpu)
    assert (w._paged_kv_indptr_buf, w._paged_kv_indices_buf, w._paged_kv_last_page_len_buf) == buffers
    assert buffers[0].tolist() == [0, 1, 3, 6] and buffers[1][:6].tolist() == [7, 2, 9, 4, 5, 6]
    assert buffers[2].tolist() == [4, 1, 1]
    assert w._cached_module.calls[0][6:8] == (3, 3) and w._cached_module.calls[0][11] is True


def test_cuda_graph_replan_rejects_other_sizes_and_overflow():
    common, inputs = decode_inputs()
    with pytest.raises(ValueError, match="for 4 requests"):
        replanner(stand_in_wrapper(cuda_graph=True, batch=4)).replan(inputs, 3, common.seq_lens_cpu)
    with pytest.raises(ValueError, match="max_model_len"):
        replanner(stand_in_wrapper(cuda_graph=True, batch=3, pages=5)).replan(inputs, 3, common.seq_lens_cpu)
