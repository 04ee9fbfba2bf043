"""transformers' trust_remote_code entry of a model converted by oal
(Outlier-Aware Attention Linearization). The model is a LlamaForCausalLM whose attention layers
run oal's kernels; the classes live in the oal package, imported here.
"""

try:
    from oal.models.hf import oal_classes
except ImportError as exc:
    raise ImportError(
        "This model was converted by oal (Outlier-Aware Attention Linearization); loading it needs the oal package. "
        "Install it with `pip install oal`, then `import oal` (or keep trust_remote_code=True)."
    ) from exc

OALLlamaConfig, OALLlamaForCausalLM = oal_classes('llama')
