"""Models other than the MNIST CNN on the same operators (README: "Bring your own model")."""
