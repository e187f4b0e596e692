package main

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"text/tabwriter"
	"time"

	"github.com/troupe-serving/troupe/membership"
)

// memberJSON is one row of `troupe members --json`.
type memberJSON struct {
	Key string `json:"key"`
	// Member's fields, sleep_state (the table's SLEEP) among them.
	membership.Member
	Lease            string  `json:"lease,omitempty"`          // hex, as etcdctl prints it
	TTLSeconds       int64   `json:"lease_ttl_seconds"`        // granted; -1: no lease or gone
	ExpiresInSeconds int64   `json:"lease_expires_in_seconds"` // left; -1: no lease or gone
	AgeSeconds       float64 `json:"age_seconds,omitempty"`    // since started_at
}

type invalidJSON struct {
	Key   string `json:"key"`
	Error string `json:"error"`
}

// headJSON is one head of `troupe members --json`.
type headJSON struct {
	Key string `json:"key"`
	membership.Head
	Lease            string  `json:"lease,omitempty"`
	TTLSeconds       int64   `json:"lease_ttl_seconds"`
	ExpiresInSeconds int64   `json:"lease_expires_in_seconds"`
	AgeSeconds       float64 `json:"age_seconds,omitempty"`
}

type membersJSON struct {
	Cluster string        `json:"cluster"`
	Members []memberJSON  `json:"members"`
	Heads   []headJSON    `json:"heads"`
	Invalid []invalidJSON `json:"invalid"` // member and head records alike
}

// runMembers lists the members of a cluster as a table or JSON.
func runMembers(ctx context.Context, args []string, stdout io.Writer) error {
	fs := newFlagSet("members")
	etcd := addEtcdFlags(fs)
	cluster := fs.String("cluster", membership.DefaultCluster, "cluster name")
	asJSON := fs.Bool("json", false, "print JSON instead of a table")
	if err := parseFlags(fs, args); err != nil {
		return err
	}
	if err := membership.ValidateCluster(*cluster); err != nil {
		return err
	}
	cli, err := membership.Dial(ctx, etcd.config())
	if err != nil {
		return err
	}
	defer cli.Close()
	listCtx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	list, err := membership.List(listCtx, cli, *cluster)
	if err != nil {
		return err
	}
	heads, err := membership.ListHeads(listCtx, cli, *cluster)
	if err != nil {
		return err
	}
	now := time.Now()
	if *asJSON {
		return writeMembersJSON(stdout, *cluster, list, heads, now)
	}
	if err := writeMembersTable(stdout, list, now); err != nil {
		return err
	}
	return writeHeadsTable(stdout, heads, now)
}

func writeMembersJSON(w io.Writer, cluster string, list []membership.Listed[membership.Member], heads []membership.Listed[membership.Head], now time.Time) error {
	out := membersJSON{Cluster: cluster, Members: []memberJSON{}, Heads: []headJSON{}, Invalid: []invalidJSON{}}
	for _, l := range list {
		if l.Invalid != nil {
			out.Invalid = append(out.Invalid, invalidJSON{Key: l.Key, Error: l.Invalid.Error()})
			continue
		}
		row := memberJSON{Key: l.Key, Member: l.Record, TTLSeconds: seconds(l.TTL), ExpiresInSeconds: seconds(l.TTLLeft)}
		if l.Lease != 0 {
			row.Lease = fmt.Sprintf("%x", int64(l.Lease))
		}
		if !l.Record.StartedAt.IsZero() {
			row.AgeSeconds = now.Sub(l.Record.StartedAt).Round(time.Millisecond).Seconds()
		}
		out.Members = append(out.Members, row)
	}
	for _, l := range heads {
		if l.Invalid != nil {
			out.Invalid = append(out.Invalid, invalidJSON{Key: l.Key, Error: l.Invalid.Error()})
			continue
		}
		row := headJSON{Key: l.Key, Head: l.Record, TTLSeconds: seconds(l.TTL), ExpiresInSeconds: seconds(l.TTLLeft)}
		if l.Lease != 0 {
			row.Lease = fmt.Sprintf("%x", int64(l.Lease))
		}
		if !l.Record.StartedAt.IsZero() {
			row.AgeSeconds = now.Sub(l.Record.StartedAt).Round(time.Millisecond).Seconds()
		}
		out.Heads = append(out.Heads, row)
	}
	enc := json.NewEncoder(w)
	enc.SetIndent("", "  ")
	return enc.Encode(out)
}

func writeMembersTable(w io.Writer, list []membership.Listed[membership.Member], now time.Time) error {
	var valid, invalid []membership.Listed[membership.Member]
	for _, l := range list {
		if l.Invalid != nil {
			invalid = append(invalid, l)
		} else {
			valid = append(valid, l)
		}
	}
	if len(valid) == 0 {
		if _, err := fmt.Fprintln(w, "(no members)"); err != nil {
			return err
		}
	} else {
		tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
		fmt.Fprintln(tw, "STAGE\tREPLICA\tADDR\tENGINE\tVERSION\tSLEEP\tLEASE TTL\tEXPIRES IN\tAGE")
		for _, l := range valid {
			m := l.Record
			fmt.Fprintf(tw, "%s\t%d\t%s\t%s\t%s\t%s\t%s\t%s\t%s\n", m.Stage, m.ReplicaID, m.Addr,
				orDash(m.Engine), orDash(m.Version), orDash(m.SleepState), ttlText(l.TTL), ttlText(l.TTLLeft), ageText(m.StartedAt, now))
		}
		if err := tw.Flush(); err != nil {
			return err
		}
	}
	for _, l := range invalid {
		if _, err := fmt.Fprintf(w, "invalid record at %s: %v\n", l.Key, l.Invalid); err != nil {
			return err
		}
	}
	return nil
}

// writeHeadsTable prints the heads after the members, one table.
func writeHeadsTable(w io.Writer, heads []membership.Listed[membership.Head], now time.Time) error {
	var valid []membership.Listed[membership.Head]
	for _, l := range heads {
		if l.Invalid == nil {
			valid = append(valid, l)
		}
	}
	if len(valid) == 0 {
		if _, err := fmt.Fprintln(w, "\n(no heads)"); err != nil {
			return err
		}
	} else {
		fmt.Fprintln(w)
		tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
		fmt.Fprintln(tw, "HEAD\tAPI ADDR\tVERSION\tLEASE TTL\tEXPIRES IN\tAGE")
		for _, l := range valid {
			h := l.Record
			fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%s\t%s\n", h.ID, h.Addr, orDash(h.Version), ttlText(l.TTL), ttlText(l.TTLLeft), ageText(h.StartedAt, now))
		}
		if err := tw.Flush(); err != nil {
			return err
		}
	}
	for _, l := range heads {
		if l.Invalid != nil {
			if _, err := fmt.Fprintf(w, "invalid record at %s: %v\n", l.Key, l.Invalid); err != nil {
				return err
			}
		}
	}
	return nil
}

// seconds is a lease duration in whole seconds, -1 staying -1.
func seconds(d time.Duration) int64 {
	if d < 0 {
		return -1
	}
	return int64(d / time.Second)
}

func ttlText(d time.Duration) string {
	if d < 0 {
		return "-"
	}
	return d.String()
}

func ageText(started, now time.Time) string {
	if started.IsZero() {
		return "-"
	}
	return now.Sub(started).Round(time.Second).String()
}

func orDash(s string) string {
	if s == "" {
		return "-"
	}
	return s
}
