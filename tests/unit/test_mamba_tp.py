"""Mamba layers under tensor parallelism (CPU, gloo): a hybrid model ("M*M*") at TP = 2, loaded
from the TP = 1 state_dict, gives TP = 1's logits (prefill, decode rows, state commit, chunked
prefill) and the controller's greedy tokens (S = 0 and S = 2); each rank's state slots hold its
own heads only."""

import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.tensor_parallel import set_tensor_model_parallel_attributes

from mtp_ctrl.models import MambaForward, PagedGPTRunner, build_gpt_model
from mtp_ctrl.models.mamba_mixer import TP_SECTIONS_ATTR, shard_full_tensor
from mtp_ctrl.state import MambaStateSlots
from tests.unit.hybrid_fixtures import LAYER_PATTERN
from tests.unit.megatron_fixtures import (
    MAX_SEQUENCE_LENGTH,
    VOCAB_SIZE,
    allocate_kv_caches,
    ensure_single_process_groups,
    free_port,
    init_process_groups,
    make_metadata,
    spawn_ranks,
    tiny_config,
    torch_twins,
)

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))  # the scripts import siblings by name
import demo_model  # noqa: E402

MTP_DEPTH = 2
BLOCKS = [3, 0, 2, 1]  # KV blocks of the one request of the logits schedule (4 tokens each)
PROMPTS = ([5, 17, 3, 88, 41], [9, 9, 2], [60, 1, 33, 70, 12, 8, 45])


def _hybrid_model(tensor_parallel_size: int):
    """hidden 64; 8 Mamba heads of 16 channels in 2 groups (4 heads, 1 group per rank at TP = 2)."""
    torch.manual_seed(4321)
    config = tiny_config(mtp_num_layers=MTP_DEPTH, tensor_parallel_size=tensor_parallel_size,
                         num_layers=len(LAYER_PATTERN), mamba_state_dim=8, mamba_head_dim=16, mamba_num_groups=2)
    model = build_gpt_model(config, VOCAB_SIZE, MAX_SEQUENCE_LENGTH, layer_pattern=LAYER_PATTERN).eval()
    for layer in model.decoder.layers:  # short prompts span several scan chunks
        if hasattr(layer.self_attention, "chunk_size"):
            layer.self_attention.chunk_size = 4
    return model


@torch.no_grad()
def _schedule_logits(runner, tensor_parallel_size: int, device=torch.device("cpu")) -> torch.Tensor:
    """Prefill 5 tokens, verify 3 rows as a decode request, commit after 1 accepted draft, decode
    token 7 as one row (Gated DeltaNet: it applies the kept rows), prefill the remaining 4 in one
    chunk -> the 12 logit rows [12, V] (on the CPU)."""
    tokens = torch.randint(0, VOCAB_SIZE, (12,), generator=torch.Generator().manual_seed(3)).to(device)
    kv_caches = allocate_kv_caches(runner.num_kv_layers, 4, 2 // tensor_parallel_size, 16, device=device)
    slots = MambaStateSlots(runner.mamba_spec, 2, 2, device)

    def forward(start, end, decode):
        metadata = make_metadata([BLOCKS], [(start, end - start)], device=device)
        rows = end - start if decode else 3  # a decode request's rows: 1 + V
        mamba = MambaForward(
            slots.conv_states, slots.ssm_states, slots.intermediate_conv_states[:, :, :rows],
            None if slots.intermediate_ssm_states is None else slots.intermediate_ssm_states[:, :, :rows],
            verify_row_inputs=slots.verify_row_inputs,  # Gated DeltaNet slots (test_gdn_tp): rows' inputs
            pending_rows=slots.pending_rows, input_parity=slots.input_parity,
            decode_slot_ids=torch.tensor([1] if decode else [], dtype=torch.int64, device=device),
            **({} if decode else dict(prefill_row_start=torch.tensor([0], device=device),
                                      prefill_row_count=torch.tensor([end - start], device=device),
                                      prefill_slot_ids=torch.tensor([1], device=device))),
        )
        logits, _ = runner.forward(tokens[start:end], metadata.positions, metadata, kv_caches, mamba=mamba)
        return logits

    rows = [forward(0, 5, decode=False), forward(5, 8, decode=True)]
    one = torch.ones(1, dtype=torch.int64, device=device)  # slot 1, 1 accepted draft
    slots.commit_accepted(torch.zeros_like(one), one, one)
    rows.append(forward(7, 8, decode=True))  # resumes after the accepted draft (row 6)
    slots.commit_accepted(torch.zeros_like(one), one, one - 1, rows_per_request=1)
    rows.append(forward(8, 12, decode=False))
    return torch.cat(rows).cpu()


def _greedy_tokens(model):
    """S = 0 and S = 2 greedy tokens. TP is the subject, not the kernels: on the CPU every op runs
    its torch twin (each kernel == its twin in its own tests); CUDA tensors still run the kernels."""
    from mtp_ctrl.controllers import InferenceConfig, SamplingParams, TextGenerationController

    outputs = []
    with torch_twins():
        for num_speculative_tokens in (0, 2):
            config = InferenceConfig(num_speculative_tokens=num_speculative_tokens, max_requests=3,
                                     block_size_tokens=4, max_model_len=32, max_tokens_per_step=16)
            results = TextGenerationController(model, config).generate(list(PROMPTS),
                                                                       SamplingParams(max_new_tokens=6))
            outputs.append([list(result.output_tokens) for result in results])
    return outputs


def tp_worker(rank: int, world_size: int, port: int, expected_path: str, device_type: str = "cpu") -> None:
    """One TP rank (spawned): loads the TP = 1 state_dict, checks its local state shapes, logits, tokens."""
    if device_type == "cuda":
        torch.cuda.set_device(rank)
    init_process_groups(rank, world_size, port, world_size, backend="nccl" if device_type == "cuda" else "gloo")
    try:
        device = torch.device(device_type, rank) if device_type == "cuda" else torch.device("cpu")
        expected = torch.load(expected_path)
        model = _hybrid_model(world_size)
        demo_model.load_full_state_dict(model, expected["state_dict"])
        model = model.to(device)
        runner = PagedGPTRunner(model)
        spec = runner.mamba_spec  # this rank's heads: 64 x channels + 8 B + 8 C; 4 heads of 16 x 8
        assert (spec.conv_state_shape, spec.ssm_state_shape) == ((80, 3), (4, 16, 8)), spec
        tolerance = dict(atol=1e-3, rtol=1e-3) if device_type == "cuda" else dict(atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(_schedule_logits(runner, world_size, device), expected["logits"], **tolerance)
        got = _greedy_tokens(model)
        assert got == expected["tokens"], f"rank {rank}: {got} != {expected['tokens']}"
    finally:
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()


def save_tp1_expected(path: str, device=torch.device("cpu")) -> str:
    """Run the TP = 1 model (in this process) and save its state_dict (CPU), logits and tokens to ``path``."""
    model = _hybrid_model(1)
    state_dict = {name: value.clone() if torch.is_tensor(value) else value
                  for name, value in model.state_dict().items()}
    model = model.to(device)
    runner = PagedGPTRunner(model)
    assert (runner.mamba_spec.conv_state_shape, runner.mamba_spec.ssm_state_shape) == ((160, 3), (8, 16, 8))
    tokens = _greedy_tokens(model)
    assert tokens[0] == tokens[1]  # speculation changes nothing
    torch.save({"state_dict": state_dict, "logits": _schedule_logits(runner, 1, device), "tokens": tokens}, path)
    return path


@pytest.fixture(scope="module")
def tp1_expected_path(tmp_path_factory):
    ensure_single_process_groups()
    return save_tp1_expected(str(tmp_path_factory.mktemp("mamba_tp") / "tp1.pt"))


def test_tp2_hybrid_matches_tp1(tp1_expected_path):
    spawn_ranks(tp_worker, (2, free_port(), tp1_expected_path))


def test_shard_full_tensor_keeps_each_ranks_chunk_of_every_section():
    # in_proj-like rows z(4) x(4) B(2) C(2) dt(2) -> rank r: z[2r:2r+2] x[2r:2r+2] B[r] C[r] dt[r]
    parameter = torch.nn.Parameter(torch.empty(7, 3))
    set_tensor_model_parallel_attributes(parameter, True, 0, 1)
    setattr(parameter, TP_SECTIONS_ATTR, (4, 4, 2, 2, 2))
    full = torch.arange(14)[:, None].expand(14, 3)
    assert shard_full_tensor(parameter, full, 0, 2)[:, 0].tolist() == [0, 1, 4, 5, 8, 10, 12]
    assert shard_full_tensor(parameter, full, 1, 2)[:, 0].tolist() == [2, 3, 6, 7, 9, 11, 13]
    plain = torch.nn.Parameter(torch.empty(3, 2))  # no sections: a contiguous chunk along partition_dim
    set_tensor_model_parallel_attributes(plain, True, 1, 1)
    assert shard_full_tensor(plain, torch.arange(12).view(3, 4), 1, 2).tolist() == [[2, 3], [6, 7], [10, 11]]
    replicated = torch.nn.Parameter(torch.empty(4))
    assert shard_full_tensor(replicated, torch.arange(4), 1, 2).tolist() == [0, 1, 2, 3]
    with pytest.raises(ValueError, match="sections"):
        shard_full_tensor(parameter, torch.zeros(15, 3), 0, 2)
    setattr(parameter, TP_SECTIONS_ATTR, (3, 5, 2, 2, 2))  # a section that does not split evenly
    with pytest.raises(ValueError, match="sections"):
        shard_full_tensor(parameter, full, 0, 2)


def test_heads_and_groups_must_split_over_the_ranks():
    ensure_single_process_groups()

    class _Group:  # a tensor-parallel group of 4 ranks, as megatron's pg_collection.tp reports it
        def size(self):
            return 4

    class _Groups:
        tp = _Group()

    from mtp_ctrl.models import PagedMambaMixer
    config = tiny_config(mtp_num_layers=0, num_layers=2, mamba_state_dim=8, mamba_head_dim=16, mamba_num_groups=2)
    with pytest.raises(ValueError, match="mamba_num_groups .2. must be divisible by the tensor-parallel size .4."):
        PagedMambaMixer(config, pg_collection=_Groups())
