"""Node plane of dlo: the loader that fills the node cache from object storage (the workload
pod's native sidecar, the prefill Job's container).

`dlo cache fill` (module `cli`) lists the checkpoint, and either finds it cached already or joins
the other nodes' loaders, each reading about 1/N of the bytes from the source and receiving
the rest from its peers, then publishes a verified entry through `dlo_contract.cache` (headers
checked by `dlo_contract.safetensors_header`). Modules: `sources` (the seam between the fill and
every scheme's reader: `s3` in `source`, the only botocore user, `file`, `gs`, `az`, `https`,
`hf`), `plan`,
`schedule` (fetch order), `fetch` (reader threads), `transport` (torch.distributed), `exchange`,
`sink`, `fill` (orchestration), `progress`, `cli`.
"""
