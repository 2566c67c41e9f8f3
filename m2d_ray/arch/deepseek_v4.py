"""DeepSeek-V4: what its layer does beyond the structure reading.

* Its first MoE layers (`mlp_layer_types == "hash_moe"`) choose their experts by token id, from a fixed table
  (`gate.tid2eid`), and weight them by the learned scores: the block reads the token ids beside its hidden states,
  which calibration hands it (`MoEAdapter.route(..., ids)`), so their statistics are the routing the model applies.
  Expanded routing cannot widen a table of k experts a token: refused where the teacher has such layers.
* Its router's score is the module's own function (`sqrtsoftplus` in the published config, not a sigmoid): the
  distribution the statistics use is that score normalised over the E experts.
* It has no dense layer kind (`mlp_layer_types` admits only `hash_moe` and `moe`), and its shared expert is as wide
  as a routed one: the student is the same class with one routed expert under a zeroed router (its hash table
  zeroed too) and the shared expert, each holding half of the method's FFN, so no zero weights are carried. The
  layers' hyper-connection streams are copied with attention (the FFN they mix in is the method's).
"""

from __future__ import annotations

from torch import Tensor, nn

from m2d_ray.arch.base import DenseFFN, Routing
from m2d_ray.arch.families import Family, StructuredAdapter
from m2d_ray.arch.structure import capture_routing, dense_state, name_of
from m2d_ray.errors import M2DError

HASH = "hash_moe"

FAMILY = Family(
    "deepseek_v4",
    renormalized=True,
    student="one-expert",
    unstreamed="its layers carry hyper-connection streams (copies of the hidden state), not one hidden state",
)


class DeepseekV4Adapter(StructuredAdapter):
    def __init__(self) -> None:
        super().__init__(FAMILY)

    def route(self, block: nn.Module, h: Tensor, ids: Tensor | None = None) -> Routing:
        if getattr(block, "is_hash", False) and ids is None:
            raise M2DError(f"{type(block).__name__} routes by token id: its routing needs the tokens' ids")
        cap = capture_routing(block, h, ids)
        scores = block.gate.score_fn(cap.logits.reshape(h.shape[0], -1).float())
        return Routing(probs=scores / scores.sum(dim=-1, keepdim=True), index=cap.index.long(), weight=cap.weight)

    def check_top_k(self, config, k: int) -> None:
        super().check_top_k(config, k)
        hashed = sum(t == HASH for t in config.mlp_layer_types)
        if hashed and k != self.top_k(config):
            raise M2DError(
                f"deepseek_v4's first {hashed} MoE layers choose {self.top_k(config)} experts a token from a fixed "
                f"table by token id: expanded routing (teacher top-k {k}) cannot widen them; keep the teacher's own k"
            )

    def student_experts(self, config) -> int:
        return 1

    def student_width_multiple(self, config) -> int:
        return 2  # half in the routed expert, half in the shared one

    def student_config(self, config, width: int):
        """One routed expert and the shared one, each of half the method's width."""
        return super().student_config(config, width // 2)

    def student_ffn_state(self, student: nn.Module, layer: int, ffn: DenseFFN) -> dict[str, Tensor]:
        block = self.ffn(self.layers(student)[layer])
        prefix = name_of(student, block) + "."
        routed, shared = ffn.part(slice(0, ffn.width // 2)), ffn.part(slice(ffn.width // 2, ffn.width))
        state = self._one_expert_state(block, prefix, routed)  # the router, its table and the shared expert zeroed
        state.update(dense_state(block.shared_experts, prefix + "shared_experts.", shared))
        return state
