package membership

import (
	"context"
	"errors"
	"log/slog"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"
)

// WatchConfig configures a Watcher.
type WatchConfig struct {
	Cluster           string
	Stages            []string      // known stage names; a record for another stage is invalid. Empty: any.
	ReconcileInterval time.Duration // full re-list period; default 30s
	OnInvalid         func(key string, err error)
	Logger            *slog.Logger
}

// Watcher turns etcd membership into ordered Events. PLACEHOLDER.
type Watcher struct{}

// NewWatcher returns a Watcher; it starts nothing.
func NewWatcher(cli *clientv3.Client, cfg WatchConfig) *Watcher { return &Watcher{} }

// Run sends events to out until ctx ends. It never closes out.
func (w *Watcher) Run(ctx context.Context, out chan<- Event) error {
	return errors.New("membership: watch not implemented")
}
