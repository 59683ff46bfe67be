"""Built-in backends, one package per backend; each registers through the `kernelmux.backends`
entry-point group exactly like a third-party plugin."""
