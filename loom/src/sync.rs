//! The model's `crate::sync`: loom's atomics under the names
//! `src/protocol.rs` uses, each with a test-only way to weaken its
//! orderings ([`Weak`]), so that a model can show what an ordering is for.

pub(crate) mod atomic {
    pub(crate) use std::sync::atomic::Ordering;

    /// Which orderings of one atomic the model weakens to `Relaxed`.
    #[derive(Debug, Clone, Copy, Default)]
    pub(crate) struct Weak {
        /// Loads (and the load half of a compare-exchange) are `Relaxed`.
        pub loads: bool,
        /// Stores (and the store half of a compare-exchange) are `Relaxed`.
        pub stores: bool,
    }

    impl Weak {
        fn load(self, o: Ordering) -> Ordering {
            if self.loads {
                Ordering::Relaxed
            } else {
                o
            }
        }
        fn store(self, o: Ordering) -> Ordering {
            if self.stores {
                Ordering::Relaxed
            } else {
                o
            }
        }
        fn rmw(self, o: Ordering) -> Ordering {
            match (self.loads, self.stores, o) {
                (false, false, o) => o,
                (true, true, _) => Ordering::Relaxed,
                (true, false, Ordering::AcqRel | Ordering::SeqCst) => Ordering::Release,
                (true, false, Ordering::Acquire) => Ordering::Relaxed,
                (false, true, Ordering::AcqRel | Ordering::SeqCst) => Ordering::Acquire,
                (false, true, Ordering::Release) => Ordering::Relaxed,
                (_, _, o) => o,
            }
        }
    }

    macro_rules! atomic {
        ($name:ident, $t:ty) => {
            /// loom's atomic of the same name, with [`Weak`] applied to
            /// every ordering it is given.
            #[derive(Debug)]
            pub(crate) struct $name {
                inner: loom::sync::atomic::$name,
                weak: Weak,
            }

            #[allow(dead_code)]
            impl $name {
                pub(crate) fn new(v: $t) -> Self {
                    Self::weakened(v, Weak::default())
                }
                pub(crate) fn weakened(v: $t, weak: Weak) -> Self {
                    $name {
                        inner: loom::sync::atomic::$name::new(v),
                        weak,
                    }
                }
                pub(crate) fn load(&self, o: Ordering) -> $t {
                    self.inner.load(self.weak.load(o))
                }
                pub(crate) fn store(&self, v: $t, o: Ordering) {
                    self.inner.store(v, self.weak.store(o))
                }
                pub(crate) fn fetch_sub(&self, v: $t, o: Ordering) -> $t {
                    self.inner.fetch_sub(v, self.weak.rmw(o))
                }
                pub(crate) fn compare_exchange(
                    &self,
                    current: $t,
                    new: $t,
                    success: Ordering,
                    failure: Ordering,
                ) -> Result<$t, $t> {
                    self.inner.compare_exchange(
                        current,
                        new,
                        self.weak.rmw(success),
                        self.weak.load(failure),
                    )
                }
            }
        };
    }

    atomic!(AtomicU64, u64);
    atomic!(AtomicU32, u32);
}
