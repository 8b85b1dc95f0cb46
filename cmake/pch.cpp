// The translation unit that carries the precompiled header the library and every program reuse.
