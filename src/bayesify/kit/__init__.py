"""The family kit: pieces several posterior families share (layers, layouts, steps, knobs,
export helpers). Imports only ``bayesify.core`` and below; families import it."""
