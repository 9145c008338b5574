"""`tinker_cookbook.renderers`: hanzo-gym's renderers under the cookbook's module name."""

from hanzo_gym.renderers import (  # noqa: F401 - re-exported
    Message,
    ParseTermination,
    Renderer,
    RendererError,
    TrainOnWhat,
    get_recommended_renderer_name,
    get_renderer,
    register_renderer,
    renderer_names,
)
