package stats

import "sync/atomic"

// The engine table maps an engine index to its pre-bound series with two
// atomic loads and no locks: a fixed array of lazily allocated pages. It
// covers every index up to MaxEngineIndex.
const (
	pageBits   = 10
	pageSize   = 1 << pageBits
	pageMask   = pageSize - 1
	maxEngines = MaxEngineIndex + 1
	numPages   = (maxEngines + pageSize - 1) / pageSize
)

type page [pageSize]atomic.Pointer[engine]

type engineTable struct {
	pages [numPages]atomic.Pointer[page]
}

// load returns the engine at index i, or nil for an unbound, negative or
// out-of-range index. Safe for concurrent use.
func (t *engineTable) load(i int) *engine {
	if uint(i) >= maxEngines { // negative indices wrap to huge values
		return nil
	}
	p := t.pages[i>>pageBits].Load()
	if p == nil {
		return nil
	}
	return p[i&pageMask].Load()
}

// store publishes e (nil to unbind) at index i, which must be in range.
// Callers serialize stores (Logger.mu); loads may run concurrently.
func (t *engineTable) store(i int, e *engine) {
	slot := &t.pages[i>>pageBits]
	p := slot.Load()
	if p == nil {
		if e == nil {
			return
		}
		p = new(page)
		slot.Store(p)
	}
	p[i&pageMask].Store(e)
}
