"""The contract between dlo's three planes: what the operator, the loader and the runtime agree on.

Owns the settings document and its validation, the error tree, the node cache format and the
safetensors header parser. Imports neither torch, boto3, kopf nor the Kubernetes client: the
operator image and the loader depend on it without them, and a test walks every module here to
keep it so.
"""

__version__ = "0.1.0"
