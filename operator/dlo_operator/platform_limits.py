"""The platform's limits on a DOD's loader code and node cache space, and the settings they yield.

The loader runs with the node cache writable, so the image it runs is the platform's choice:
`spec.loader.image` must be the chart's `loaderImage` or one of `allowedLoaderImages`, compared as
whole references. The node cache is shared by every DOD on the node, so its size limit and
free-space floor are the platform's (`nodeCache.maxBytes`, `nodeCache.minFreeBytes`): a DOD may
ask for less space for its own entry (`cache.maxBytes`) and a higher floor (`cache.minFreeBytes`),
never more space nor a lower floor, and only the platform's values evict (the loader's `room`).
`with_platform_limits` writes the effective values into the settings the pods read. Pure; called
by `admission`.
"""

from __future__ import annotations

from dlo_contract.settings import Settings
from dlo_contract.validation import cr_names
from dlo_operator.installation import InstallationConfig
from dlo_operator.spec import DeploymentSpec


def loader_image_problems(spec: DeploymentSpec, installation: InstallationConfig) -> list[str]:
    image, allowed = spec.loader.image, installation.loader_images
    if image in allowed:
        return []
    return [f"spec.loader.image={image!r} is not a loader image the platform allows (chart "
            f"values loaderImage and allowedLoaderImages: {', '.join(allowed)}); the loader "
            "writes the node cache other pods map, so it runs only code the platform chose: "
            f"leave spec.loader.image empty to use {installation.loader_image}, or ask the "
            "cluster administrator to add the image to allowedLoaderImages"]


def cache_limit_problems(settings: Settings, installation: InstallationConfig) -> list[str]:
    """A DOD asking for more of the node cache than the platform's limit, or a lower floor."""
    cache, problems = settings.cache, []
    node_max, node_floor = (installation.node_cache_max_bytes,
                            installation.node_cache_min_free_bytes)
    if node_max and cache.max_bytes > node_max:
        problems.append(
            f"{cr_names('cache.max_bytes')}={cache.max_bytes} is more than the node cache's "
            f"limit of {node_max} bytes that the platform sets for every DOD on the node (chart "
            f"value nodeCache.maxBytes); ask for at most {node_max}, or 0 to take the limit")
    if cache.min_free_bytes and cache.min_free_bytes < node_floor:
        problems.append(
            f"{cr_names('cache.min_free_bytes')}={cache.min_free_bytes} is less than the free "
            f"space of {node_floor} bytes that the platform keeps on every node cache (chart "
            f"value nodeCache.minFreeBytes); ask for {node_floor} or more, or 0 to take it")
    return problems


def with_platform_limits(settings: Settings, installation: InstallationConfig) -> Settings:
    """`settings` with the node's limits written in and the DOD's own asks made effective: 0
    takes the platform's value, a higher floor stays."""
    cache = settings.cache
    node_max, node_floor = (installation.node_cache_max_bytes,
                            installation.node_cache_min_free_bytes)
    effective = cache.model_copy(update={
        "max_bytes": cache.max_bytes or node_max,
        "min_free_bytes": max(cache.min_free_bytes, node_floor),
        "node_max_bytes": node_max, "node_min_free_bytes": node_floor})
    return settings.model_copy(update={"cache": effective})
