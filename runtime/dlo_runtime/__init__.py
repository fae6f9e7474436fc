"""Pod plane of dlo, plus the contract modules shared by every plane.

`settings`, `validation`, `errors`, `safetensors_header` and `cache` import neither torch,
boto3 nor kopf: the operator and the loader depend on them. Everything that needs torch lives in the other modules of this package and
is imported only when used.
"""

__version__ = "0.1.0"
