"""Libraries shared by the services: protocol, bus, models, recipe, kernels."""
