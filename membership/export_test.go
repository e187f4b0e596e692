package membership

import "time"

// SetWatchTestHooks shortens the list timeout and reports every list's
// outcome, so tests wait on what happened instead of sleeping.
func SetWatchTestHooks(w *Watcher, listTimeout time.Duration, onResync func(rev int64, err error)) {
	w.listTimeout = listTimeout
	w.onResync = onResync
}
