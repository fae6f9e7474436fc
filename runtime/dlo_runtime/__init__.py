"""Pod plane of dlo: map the node cache, plan host weights, run the DLO backend.

Everything that needs torch lives here and is imported only when used; the settings, validation,
errors and cache format this plane reads come from `dlo_contract`.
"""

__version__ = "0.1.0"
