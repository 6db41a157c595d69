"""Full parameter names, ``layers.<i>.<name>`` (pure).

The model seam names every parameter by its layer in the whole model
(``runtime.model_api``, which re-exports ``layer_of``), whatever stage holds it; the
checkpoint's keys are those names (``ckpt.state``), so both read the layer from here.
"""

from __future__ import annotations


def layer_of(full_name: str) -> int:
    """The layer index in a full parameter name ``layers.<i>.<...>``."""
    head, index, _rest = full_name.split(".", 2)
    if head != "layers" or not index.isdigit():
        raise ValueError(f"{full_name!r} is not a full parameter name (layers.<i>.<name>)")
    return int(index)
