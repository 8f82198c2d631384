"""EAGLE3: a one-layer Llama draft head that reads three target layers' hidden states, in the checkpoint layout
the published EAGLE3 drafts use with vLLM and SGLang (e.g. Inferact/MiniMax-M3-EAGLE3).

Checkpoint (`config.json` + `model.safetensors` or `pytorch_model.bin`):
  config: `architectures: ["LlamaForCausalLMEagle3"]`, Llama fields (hidden_size, num_attention_heads,
    num_key_value_heads, head_dim, intermediate_size, rms_norm_eps, rope_theta, vocab_size), `draft_vocab_size`,
    optional `target_hidden_size`, `norm_before_residual`, and the aux layers in `eagle_aux_hidden_state_layer_ids`
    (top level, or inside `eagle_config`, which may also say `use_aux_hidden_state`). The speculators layout
    (`Eagle3Speculator`, Llama fields inside `transformer_layer_config`) is read too.
  tensors: `midlayer.{input_layernorm,hidden_norm,post_attention_layernorm}.weight`,
    `midlayer.self_attn.{q,k,v,o}_proj.weight` (q/k/v take 2 * hidden inputs),
    `midlayer.mlp.{gate,up,down}_proj.weight`,
    `fc.weight` [hidden, 3 * target_hidden], `norm.weight`, `lm_head.weight` [draft_vocab, hidden],
    `d2t` int64 [draft_vocab] (target id = draft id + d2t[draft id]), `t2d` bool [vocab], and optionally
    `embed_tokens.weight` (absent: the target's embedding is shared). `layers.0.*` is accepted for `midlayer.*`.

Aux layer ids follow vLLM: id i is the hidden state *entering* target layer i (transformers' hidden_states[i]);
default (2, n // 2, n - 3). (SGLang shifts explicit ids by one: it reads id i as layer i's output.)

The draft step at position t reads the target's aux states at t and the embedding of token t + 1 and predicts
token t + 2; its later steps feed back its own pre-norm output instead of the target's states. It keeps its own
small KV cache per request (positions it has seen), so it needs nothing from the target's paged cache.

The package: the checkpoint's config (config.py), the head as trained (head.py), reading and writing its checkpoint
(checkpoint.py), the per-request draft KV pool (draft_cache.py), and the drafter that serves it (drafter.py, with
its CUDA graphs' packed inputs in read_inputs.py).
"""

from m3sdk.errors import CheckpointError
from m3sdk.speculative.base import SpecConfig, TargetInfo, register
from m3sdk.speculative.eagle3.checkpoint import bundled_head_path, load_eagle3, save_eagle3
from m3sdk.speculative.eagle3.config import Eagle3Config, default_aux_layers
from m3sdk.speculative.eagle3.drafter import Eagle3Drafter
from m3sdk.speculative.eagle3.head import Eagle3Head

__all__ = ["Eagle3Config", "Eagle3Drafter", "Eagle3Head", "bundled_head_path", "default_aux_layers", "load_eagle3",
           "save_eagle3"]


@register("eagle3")
def build(config: SpecConfig, target: TargetInfo) -> Eagle3Drafter:
    path = config.model or bundled_head_path(target.checkpoint)
    if path is None:
        raise CheckpointError("speculative eagle3 needs a draft head: pass {'model': path} (only the bundled "
                              "m3-tiny ships one)")
    return Eagle3Drafter(load_eagle3(path, target), config.num_speculative_tokens, target.max_num_seqs,
                         target.max_model_len or None)
