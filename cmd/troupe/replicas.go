package main

import (
	"bufio"
	"cmp"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/url"
	"os"
	"strconv"
	"strings"
	"time"

	"github.com/troupe-serving/troupe/orchestrator"
)

// replicasDetail is the help's text after the summary.
const replicasDetail = `Reads GET /v1/replicas from a head: each replica's stage, id, engine index, state,
address, requests in flight, load and, when it is not routed, why. --watch follows them:
the table, then a line each time a replica joins, is routed, leaves or changes state,
until Ctrl-C. The key comes from --api-key-file, else TROUPE_ADMIN_API_KEY, else
TROUPE_API_KEY (a head with an admin key takes only it here), never the command line.`

// replicasHeader is the header of the table and of --watch's lines.
const replicasHeader = "STAGE      REPLICA  INDEX  STATE      ADDR                   IN_FLIGHT  LOAD  REASON"

type replicasFlags struct {
	url, apiKeyFile, stage, state string
	watch, json                   bool
}

// runReplicas runs `troupe replicas`.
func runReplicas(ctx context.Context, args []string, stdout io.Writer) error {
	fs := newFlagSet("replicas")
	var f replicasFlags
	fs.StringVar(&f.url, "url", "http://127.0.0.1:8000", "the head's `base` URL (its admin listener where it has one), with or without /v1")
	fs.StringVar(&f.apiKeyFile, "api-key-file", "", "`file` holding the admin key, or the API key on a head without one (default: $TROUPE_ADMIN_API_KEY, else $TROUPE_API_KEY)")
	fs.StringVar(&f.stage, "stage", "", "list one stage only: its `name` or index")
	fs.StringVar(&f.state, "state", "", "list one `state` only: attached, sleeping, unhealthy or detached (not with --watch)")
	fs.BoolVar(&f.watch, "watch", false, "follow the replicas as they change, until Ctrl-C")
	fs.BoolVar(&f.json, "json", false, "print the head's JSON: the list, or with --watch its lines as they come")
	if err := parseFlags(fs, args); err != nil {
		return err
	}
	if f.watch && f.state != "" {
		return errors.New("replicas: --state with --watch: a watch shows replicas leaving a state too; filter its lines instead")
	}
	key := cmp.Or(os.Getenv("TROUPE_ADMIN_API_KEY"), os.Getenv("TROUPE_API_KEY"))
	if f.apiKeyFile != "" {
		k, err := readKeyFile("--api-key-file", f.apiKeyFile)
		if err != nil {
			return fmt.Errorf("replicas: %w", err)
		}
		key = k
	}
	q := url.Values{}
	if f.stage != "" {
		q.Set("stage", f.stage)
	}
	if f.state != "" {
		q.Set("state", f.state)
	}
	if f.watch {
		q.Set("watch", "true")
	}
	target := strings.TrimSuffix(strings.TrimSuffix(f.url, "/"), "/v1") + "/v1/replicas"
	if len(q) > 0 {
		target += "?" + q.Encode()
	}
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, target, nil)
	if err != nil {
		return fmt.Errorf("replicas: --url: %w", err)
	}
	if key != "" {
		req.Header.Set("Authorization", "Bearer "+key)
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return fmt.Errorf("replicas: is the head at %s? %w", f.url, err)
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return headRefusal(resp)
	}
	if f.watch {
		return followReplicas(ctx, resp.Body, stdout, f.json)
	}
	if f.json {
		_, err := io.Copy(stdout, resp.Body)
		return err
	}
	var list struct {
		Data []orchestrator.ReplicaStatus `json:"data"`
	}
	if err := json.NewDecoder(resp.Body).Decode(&list); err != nil {
		return fmt.Errorf("replicas: the head's answer: %w", err)
	}
	w := bufio.NewWriter(stdout)
	fmt.Fprintln(w, replicasHeader)
	for i := range list.Data {
		writeReplicaRow(w, &list.Data[i])
	}
	return w.Flush()
}

// followReplicas prints a watch's lines until ctx ends (Ctrl-C: no error)
// or the head ends the stream (an error: it is shutting down).
func followReplicas(ctx context.Context, body io.Reader, stdout io.Writer, raw bool) error {
	lines := bufio.NewScanner(body)
	lines.Buffer(make([]byte, 64<<10), 1<<20)
	if !raw {
		fmt.Fprintln(stdout, "TIME         "+replicasHeader)
	}
	for lines.Scan() {
		if raw {
			if _, err := fmt.Fprintf(stdout, "%s\n", lines.Bytes()); err != nil {
				return err
			}
			continue
		}
		var ev struct {
			Type    string                      `json:"type"`
			Replica *orchestrator.ReplicaStatus `json:"replica"`
		}
		if err := json.Unmarshal(lines.Bytes(), &ev); err != nil {
			return fmt.Errorf("replicas: the head's watch: %w", err)
		}
		switch {
		case ev.Type == "synced":
			fmt.Fprintln(stdout, "-- following; a line per change, Ctrl-C to stop")
		case ev.Type == "replica" && ev.Replica != nil:
			fmt.Fprint(stdout, time.Now().Format("15:04:05.000 "))
			writeReplicaRow(stdout, ev.Replica)
		}
	}
	if ctx.Err() != nil {
		return nil // Ctrl-C
	}
	if err := lines.Err(); err != nil {
		return fmt.Errorf("replicas: the head's watch: %w", err)
	}
	return errors.New("replicas: the head ended the watch (it is shutting down); run it again, against another head if need be")
}

// writeReplicaRow writes one row of the table.
func writeReplicaRow(w io.Writer, r *orchestrator.ReplicaStatus) {
	load := "-"
	if r.Load != nil {
		load = strconv.FormatInt(*r.Load, 10)
	}
	fmt.Fprintf(w, "%-10s %7d %6d  %-10s %-22s %9d %5s  %s\n", r.StageName, r.Replica, r.EngineIndex, r.State, r.Addr, r.InFlight, load, r.Reason)
}

// headRefusal is the error of a head that did not answer 200: its
// OpenAI-style message when it sent one.
func headRefusal(resp *http.Response) error {
	body, _ := io.ReadAll(io.LimitReader(resp.Body, 64<<10))
	var e struct {
		Error struct {
			Message string `json:"message"`
		} `json:"error"`
	}
	if json.Unmarshal(body, &e) == nil && e.Error.Message != "" {
		return fmt.Errorf("replicas: the head answered %d: %s", resp.StatusCode, e.Error.Message)
	}
	return fmt.Errorf("replicas: the head answered %s: %s", resp.Status, strings.TrimSpace(string(body)))
}
