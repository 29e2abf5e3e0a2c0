"""OLMo-2: q/k RMSNorm and norms after attention and after the MLP.

Counted as four norms per layer with q/k norms of head_dim each, as the estimate always has; the
stock layer has two (post-attention, post-feed-forward) and q/k norms over all heads, a few
thousand parameters apart on a billion-parameter model (pessimistic by design)."""

from engine.models.arch.spec import Arch

ARCH = Arch("olmo2", extra_norms=("post_attention_layernorm", "post_feedforward_layernorm"), qk_norm=True)
