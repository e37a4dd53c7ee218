"""Fixtures of the EAGLE tests: a target whose greedy tokens come from a small set (so a
random-weight head's drafts are often accepted and every accept count occurs), its dense twin,
a random head and its dense twin, and the dense oracle of the drafts."""

from typing import List, Sequence, Tuple

import torch

from mtp_ctrl.controllers import EagleProposer
from mtp_ctrl.controllers.proposers import DraftBatch
from mtp_ctrl.models import build_eagle_head
from mtp_ctrl.models.eagle_head import dense_eagle_forward, eagle_logits
from tests.unit.megatron_fixtures import build_dense_twin, build_tiny_model, tiny_config

AUX_LAYERS = (0, 1)
LIVE_TOKENS = 5  # output rows >= this are zero: greedy tokens fall in [0, 5]


def build_eagle_models(tensor_parallel_size: int = 1, live_tokens: int = LIVE_TOKENS):
    """(paged target, dense target, paged head, dense head), same weights, fp32, CPU."""
    config = tiny_config(mtp_num_layers=0, tensor_parallel_size=tensor_parallel_size) if tensor_parallel_size > 1 \
        else tiny_config(mtp_num_layers=0)
    model = build_tiny_model(config)
    with torch.no_grad():
        weight = model.output_layer.weight  # [V / tp, H]: zero the rows of tokens >= live_tokens
        first_row = weight.shape[0] * (torch.distributed.get_rank() if tensor_parallel_size > 1 else 0)
        rows = torch.arange(weight.shape[0]) + first_row
        weight[rows >= live_tokens] = 0
    torch.manual_seed(77)
    head = build_eagle_head(model, AUX_LAYERS).eval()
    if tensor_parallel_size > 1:
        return model, None, head, None
    dense = build_dense_twin(config, model)
    dense_head = build_eagle_head(dense, AUX_LAYERS, dense=True).eval()
    dense_head.load_state_dict(head.state_dict())
    return model, dense, head, dense_head


def recording(proposer_class):
    """``proposer_class`` that also records ``(request_id, e, drafts)`` of every proposal in
    ``.proposals`` (test-only device reads)."""

    class Recording(proposer_class):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.proposals: List[Tuple[int, int, List[int]]] = []

        def propose(self, batch: DraftBatch) -> torch.Tensor:
            drafts = super().propose(batch)
            num_sampling = batch.step.num_sampling_requests
            ends = batch.bonus_positions[:num_sampling].tolist()
            for index, request_id in enumerate(batch.step.request_ids[:num_sampling]):
                self.proposals.append((request_id, ends[index], drafts[index].tolist()))
            return drafts

    Recording.__name__ = Recording.__qualname__ = "Recording" + proposer_class.__name__
    return Recording


RecordingEagleProposer = recording(EagleProposer)


@torch.no_grad()
def dense_aux(dense, tokens: torch.Tensor, layers: Sequence[int] = AUX_LAYERS) -> torch.Tensor:
    """``[n, k * H]``: the outputs of ``layers`` in a full causal forward of the dense target."""
    outputs = {}
    hooks = [dense.decoder.layers[layer].register_forward_hook(
        lambda module, args, output, layer=layer: outputs.__setitem__(layer, output[0][:, 0])) for layer in layers]
    try:
        embedded = dense.embedding(input_ids=tokens[None], position_ids=torch.arange(tokens.shape[0])[None])
        dense.decoder(hidden_states=embedded, attention_mask=None, rotary_pos_emb=dense.rotary_pos_emb(tokens.shape[0]))
    finally:
        for hook in hooks:
            hook.remove()
    return torch.cat([outputs[layer] for layer in layers], dim=-1)


@torch.no_grad()
def dense_eagle_drafts(dense, dense_head, tokens: Sequence[int], num_drafts: int) -> List[int]:
    """Greedy drafts after ``tokens`` = ``t_0 .. t_e``: step 1 over positions ``[0, e)`` with the
    target's aux states; step k extends the sequence by the previous output and draft (causal,
    so the earlier rows are unchanged, as in the paged cache)."""
    tokens = torch.tensor(tokens, dtype=torch.int64)
    features = dense_head.project_aux(dense_aux(dense, tokens[:-1]))  # [e, H]
    next_tokens = tokens[1:]  # [e]
    drafts = []
    for _ in range(num_drafts):
        out = dense_eagle_forward(dense, dense_head, features[:, None], next_tokens[None])  # [n, 1, H]
        draft = int(eagle_logits(dense, out[-1:])[0, 0].argmax())
        drafts.append(draft)
        features = torch.cat([features, out[-1:, 0]])
        next_tokens = torch.cat([next_tokens, torch.tensor([draft])])
    return drafts


def plain_greedy_outputs(target, max_new_tokens: int = 10) -> List[List[int]]:
    """Plain greedy decoding of every PROMPT on ``target``: the reference the drafters' outputs
    must equal (torch twins: plain decoding's kernels are tested elsewhere)."""
    from mtp_ctrl.controllers import SamplingParams
    from tests.unit.controller_fixtures import PROMPTS, make_controller
    from tests.unit.megatron_fixtures import torch_twins

    with torch_twins():
        results = make_controller(target, 0).generate([list(p) for p in PROMPTS],
                                                      SamplingParams(max_new_tokens=max_new_tokens))
    return [list(r.output_tokens) for r in results]


def assert_drafts_equal_dense(model, proposer, S: int, plain_greedy, dense_drafts, limit=None) -> None:
    """Serve PROMPTS[2:] with a recording ``proposer`` at S drafts, the 12-token prompt prefilled in
    two chunks (max_tokens_per_step 10): the output equals plain decoding, and each of the first
    ``limit`` proposals equals ``dense_drafts(verified tokens up to e)`` (at least 6 checked, and
    the drafts do get accepted sometimes)."""
    from mtp_ctrl.controllers import SamplingParams
    from tests.unit.controller_fixtures import PROMPTS, make_controller

    controller = make_controller(model, S, proposer=proposer, max_requests=2, max_tokens_per_step=10)
    results = controller.generate([list(p) for p in PROMPTS[2:]], SamplingParams(max_new_tokens=10))
    assert [list(r.output_tokens) for r in results] == plain_greedy[2:]
    request_ids = sorted({rid for rid, _, _ in proposer.proposals})
    sequences = {rid: list(PROMPTS[2 + index]) + plain_greedy[2 + index] for index, rid in enumerate(request_ids)}
    checked = accepted = 0
    for request_id, end, drafts in proposer.proposals[:limit]:
        sequence = sequences[request_id]
        if end + 1 >= len(sequence):
            continue  # a step run past the request's stop (overlap): its drafts are discarded
        assert drafts == dense_drafts(sequence[: end + 1]), (request_id, end)
        checked += 1
        accepted += drafts[0] == sequence[end + 1]
    assert checked >= 6 and accepted > 0


def outputs_with_a_pause(controller) -> List[List[int]]:
    """Every PROMPT through the step API, request 1 paused for three steps after three steps."""
    from mtp_ctrl.controllers import SamplingParams
    from tests.unit.controller_fixtures import PROMPTS

    ids = [controller.add_request(list(p), SamplingParams(max_new_tokens=10)) for p in PROMPTS]
    for _ in range(3):
        controller.step()
    controller.pause_request(ids[1])
    for _ in range(3):
        controller.step()
    controller.resume_request(ids[1])
    while controller.has_unfinished_requests():
        controller.step()
    return [list(controller.result(i).output_tokens) for i in ids]

