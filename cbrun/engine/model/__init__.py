"""Model families and loading: the lean forward pass over shared layers, configs, weights, loaders."""
