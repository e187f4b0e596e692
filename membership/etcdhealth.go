package membership

import (
	"context"
	"log/slog"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"
)

// DefaultHealthInterval is the period of MonitorEtcd's probe.
const DefaultHealthInterval = 2 * time.Second

// HealthConfig configures MonitorEtcd.
type HealthConfig struct {
	// Interval between probes, also each probe's timeout; default
	// DefaultHealthInterval.
	Interval time.Duration
	// Who names the process in the log lines ("troupe head", "worker
	// thinker/0").
	Who string
	// OnChange is called from MonitorEtcd's goroutine with the first
	// result and at every change. It must not block.
	OnChange func(up bool)
	Logger   *slog.Logger
}

// MonitorEtcd probes etcd every Interval with a linearizable read (one
// that needs a leader, as membership does) until ctx ends. It logs one
// warning when etcd stops answering and one line when it answers again,
// with how long it was gone, so an outage is visible in every process's
// log even when nothing else happens; OnChange follows the same
// transitions (for a gauge). Run it in a goroutine the caller owns.
func MonitorEtcd(ctx context.Context, cli *clientv3.Client, cfg HealthConfig) {
	if cfg.Interval <= 0 {
		cfg.Interval = DefaultHealthInterval
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.Default()
	}
	key := KeyRoot + "health" // any key: the read, not its value, is the probe
	var up, known bool
	var downSince time.Time
	tick := time.NewTicker(cfg.Interval)
	defer tick.Stop()
	for {
		pctx, cancel := context.WithTimeout(ctx, cfg.Interval)
		_, err := cli.Get(clientv3.WithRequireLeader(pctx), key, clientv3.WithCountOnly())
		cancel()
		if ctx.Err() != nil {
			return
		}
		now := err == nil
		switch {
		case known && now == up:
		case !now:
			downSince = time.Now()
			cfg.Logger.Warn("membership: etcd unreachable; membership is frozen at its last state until it answers", "who", cfg.Who, "endpoints", cli.Endpoints(), "err", err)
		case known:
			cfg.Logger.Info("membership: etcd reachable again", "who", cfg.Who, "endpoints", cli.Endpoints(), "down_for", time.Since(downSince).Round(time.Millisecond))
		}
		if !known || now != up {
			up, known = now, true
			if cfg.OnChange != nil {
				cfg.OnChange(up)
			}
		}
		select {
		case <-ctx.Done():
			return
		case <-tick.C:
		}
	}
}
