"""Planning: profile the layers, balance the stages, search the fastest pipeline that fits."""
