"""kqsvd: apply low-rank KV-cache projections (proj.h5, written by
`kqsvd calibrate`) in transformers models and measure their cost.

    import kqsvd
    proj = kqsvd.load_projections("proj.h5", "kqsvd", ranks="budget:0.25")
    with kqsvd.compressed(model, proj):  # the cache holds K A and V A_v
        out = model.generate(ids, max_new_tokens=20)
    # here the model is exactly as it was; kqsvd.compress(model, proj)
    # installs the projections until kqsvd.compress(model, None)

numpy and h5py suffice for load_projections and kqsvd.Calibrator (the C
library's accumulator: docs/guide/c-library.md); compress and
export_safetensors need torch (and transformers' models)."""
from .calibration.calibrator import Calibrator
from .errors import KqsvdError, UsageError
from .formats.h5io import read as read_dataset
from .formats.projections import METHODS, Projections, load_projections, policy_ranks
from .formats.saving import save_ranks
from .version import __version__ as __version__

__all__ = ["KqsvdError", "UsageError", "METHODS", "Projections", "load_projections",
           "policy_ranks", "save_ranks", "compress", "compressed", "fold_o_proj", "cache_bytes",
           "probe_errors", "latent_cache", "reading_codes", "export_safetensors", "read_dataset",
           "Calibrator"]


def __getattr__(name):  # the parts that need torch load on first use
    if name in ("compress", "compressed", "fold_o_proj", "cache_bytes", "probe_errors",
                "latent_cache", "reading_codes"):
        from . import attention  # torch at its top
        return getattr(attention, name)
    if name == "export_safetensors":
        from .attention.export import export_safetensors  # torch at kqsvd.attention's top
        return export_safetensors
    raise AttributeError(name)
