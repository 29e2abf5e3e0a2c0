"""OLMo-Hybrid: gated delta-rule linear attention between attention layers. Those layers carry state
along a row (transformers refuses a packed row without flash-linear-attention), so each document runs
alone. Not patched."""

from engine.models.arch.spec import Arch

ARCH = Arch("olmo_hybrid", row_state=True)
