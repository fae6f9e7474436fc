"""The control plane: a kopf operator for `DiffusionOffloadDeployment` (short name `dod`).

Layers, imports only going down:
    handlers, cli, render      kopf handlers, `dlo operator run`, `dlo render`
    kube                       the only module that calls the Kubernetes API client
    manifests, status          pure: spec -> child manifests, pods -> status
    configmap, service, statefulset, pod   pure builders, one per concern
    spec, naming, errors       CR spec parsing (-> `dlo_contract.settings.Settings`), names, errors

Importing this package imports neither torch nor kopf nor the Kubernetes client: the builders and
`dlo render` need the contract package (`dlo_contract`), PyYAML and the validators the
operator extra pins (jsonschema, cel-python, kubernetes-validate), never the runtime or torch.
"""
