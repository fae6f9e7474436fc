"""`dlo serve`: a reference inference server over the pod API (`dlo_runtime.pod`), with an
OpenAI-style images API, probes that tell a filling loader from a broken server, `/metrics`, and
request waves that keep the ranks of a DLO AllGather group in step. See `dlo_server.cli`."""
