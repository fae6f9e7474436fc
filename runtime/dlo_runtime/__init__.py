"""Pod plane of dlo: map the node cache, plan host weights, run the DLO backend.

Everything that needs torch lives here and is imported only when used; the settings, validation,
errors and cache format this plane reads come from `dlo_contract`.
"""

__version__ = "0.1.0"


def is_enabled(module: object) -> bool:
    """Whether a DLO backend streams `module` now (a DiT, or a pipeline holding one)."""
    from dlo_runtime.discovery import DIT_ATTRIBUTES
    from dlo_runtime.misuse import MARK_ATTRIBUTE, OffloadMark

    targets = [module] + [getattr(module, a, None) for a in DIT_ATTRIBUTES]
    return any(getattr(t, MARK_ATTRIBUTE, None) is OffloadMark.ENABLED for t in targets)
