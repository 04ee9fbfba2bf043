"""oal: Outlier-Aware Attention Linearization (grouped positive quadratic kernels, linear in sequence length)."""

__version__ = "0.1.0"

# Converted models are their own transformers model types (oal_llama, …): registering them with the Auto classes
# here is what makes AutoModelForCausalLM.from_pretrained(converted_dir) work after `import oal`.
from .models.hf import register as _register  # noqa: E402

_register()
