"""`python -m support.server_reference MODEL_DIR JOBS_JSON`: each job (the fields of
`dlo_server.sampler.Job`) made by a resident pipeline in this one process with one thread;
rewrites JOBS_JSON with the PNGs, base64."""

from __future__ import annotations

import base64
import json
import sys
from pathlib import Path

import torch

from dlo_server.requests import Job
from dlo_server.sampler import FluxSampler, resident_dit


def main(model: Path, jobs_file: Path) -> None:
    torch.set_num_threads(1)
    device = torch.device("cpu")
    sampler = FluxSampler(resident_dit(model, device), model, device)
    jobs = [Job(**fields) for fields in json.loads(jobs_file.read_text())]
    images = [base64.b64encode(sampler.generate(job)).decode() for job in jobs]
    jobs_file.write_text(json.dumps(images))


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]))
