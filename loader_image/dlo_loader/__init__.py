"""Node plane of dlo: the loader that fills the node cache from object storage (the workload
pod's native sidecar, the prefill Job's container).

`dlo cache fill` (module `cli`) lists the checkpoint, and either finds it cached already or joins
the other nodes' loaders, each reading about 1/N of the bytes from the object store and receiving
the rest from its peers, then publishes a verified entry through `dlo_contract.cache` (headers
checked by `dlo_contract.safetensors_header`). Modules: `source` (the only botocore user), `plan`,
`schedule` (fetch order), `fetch` (reader threads), `transport` (torch.distributed), `exchange`,
`sink`, `fill` (orchestration), `progress`, `cli`.
"""
