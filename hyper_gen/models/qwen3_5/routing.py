"""The routed-experts side of both Qwen3.5 ports' model classes (a mixin: the MoE layers are the
ports'), what ``hyper_gen.outputs.RoutedExperts`` reads for routing replay (R3)."""


class RoutedExpertsSource:
    """``moe_layers`` and ``record_routes`` over ``self.layers``, whose MoE MLPs hold ``routes``."""

    @property
    def moe_layers(self) -> int:
        """The MoE layer count (0 for a dense model)."""
        return sum(hasattr(layer.mlp, "routes") for layer in self.layers)

    def record_routes(self, routes) -> None:
        """Given a list, every MoE layer appends its (tokens, top_k) expert ids of each forward to
        it, in layer order; None stops it."""
        for layer in self.layers:
            if hasattr(layer.mlp, "routes"):
                layer.mlp.routes = routes


__all__ = ["RoutedExpertsSource"]
