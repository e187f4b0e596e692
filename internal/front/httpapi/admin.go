package httpapi

import (
	"context"
	"net/http"
	"slices"
	"strconv"

	"github.com/troupe-serving/troupe/orchestrator"
	"github.com/troupe-serving/troupe/pkg/stagepb"
)

// models serves GET /v1/models: the pipeline's one model.
func (s *Server) models(w http.ResponseWriter, _ *http.Request) {
	writeJSON(w, http.StatusOK, modelList{Object: "list", Data: []modelCard{s.modelCard()}})
}

// model serves GET /v1/models/{model}.
func (s *Server) model(w http.ResponseWriter, r *http.Request) {
	card := s.modelCard()
	if name := r.PathValue("model"); name != card.ID {
		writeError(w, notFound("model", "model_not_found", "the model %q does not exist; this server serves %q", name, card.ID))
		return
	}
	writeJSON(w, http.StatusOK, card)
}

func (s *Server) modelCard() modelCard {
	return modelCard{ID: s.b.Pipeline().Model, Object: "model", Created: s.created, OwnedBy: "troupe"}
}

// healthz serves GET /healthz: the process is up.
func (s *Server) healthz(w http.ResponseWriter, _ *http.Request) {
	writeText(w, http.StatusOK, "ok")
}

// readyz serves GET /readyz: 200 when every stage has a routable replica,
// else 503 naming the stage that has none; 503 "shutting down" once the
// head drains (Drain).
func (s *Server) readyz(w http.ResponseWriter, _ *http.Request) {
	if s.draining.Load() {
		writeError(w, &apiError{Status: http.StatusServiceUnavailable, Type: typeServer, Code: "shutting_down", Message: "not ready: shutting down"})
		return
	}
	if ok, reason := s.b.Ready(); !ok {
		writeError(w, &apiError{Status: http.StatusServiceUnavailable, Type: typeServer, Code: "not_ready", Message: "not ready: " + reason})
		return
	}
	writeText(w, http.StatusOK, "ok")
}

func writeText(w http.ResponseWriter, status int, text string) {
	w.Header().Set("Content-Type", "text/plain; charset=utf-8")
	w.Header().Set("Cache-Control", "no-store")
	w.WriteHeader(status)
	_, _ = w.Write([]byte(text + "\n"))
}

// replicas serves GET /v1/replicas: every replica the head knows,
// detached ones included; ?stage= (a name or an index) and ?state= list
// some only, and ?watch=true follows them (watchReplicas).
func (s *Server) replicas(w http.ResponseWriter, r *http.Request) {
	q := r.URL.Query()
	stage := -1
	if v := q.Get("stage"); v != "" {
		i, err := s.b.ResolveStage(v)
		if err != nil {
			e := fromBackend(err, requestIDFrom(r.Context()))
			s.reject(w, r, badRequest("stage", "invalid_value", "%s", e.Message))
			return
		}
		stage = i
	}
	state := orchestrator.ReplicaState(q.Get("state"))
	switch state {
	case "", orchestrator.StateAttached, orchestrator.StateSleeping, orchestrator.StateUnhealthy, orchestrator.StateDetached:
	default:
		s.reject(w, r, badRequest("state", "invalid_value", "state must be attached, sleeping, unhealthy or detached, got %q", state))
		return
	}
	watch := false
	if v := q.Get("watch"); v != "" {
		b, err := strconv.ParseBool(v)
		if err != nil {
			s.reject(w, r, badRequest("watch", "invalid_value", "watch must be true or false, got %q", v))
			return
		}
		watch = b
	}
	if watch {
		if state != "" {
			// A row leaves a state as often as it enters one: a watch
			// filtered by state would miss the leaving.
			s.reject(w, r, badRequest("state", "invalid_value", "state filters a list, not a watch: watch every state and filter the rows"))
			return
		}
		s.watchReplicas(w, r, stage)
		return
	}
	rows := s.b.Replicas()
	if stage >= 0 || state != "" {
		rows = slices.DeleteFunc(rows, func(row orchestrator.ReplicaStatus) bool {
			return (stage >= 0 && row.Stage != stage) || (state != "" && row.State != state)
		})
	}
	writeJSON(w, http.StatusOK, replicaList{Data: rows})
}

// replicasSD serves GET /v1/replicas/sd: Prometheus HTTP service discovery
// (http_sd_config) over the replicas the head routes or will route.
// Each replica is a target group by its gRPC address, labelled
// endpoint="grpc" (for a gRPC health probe, not a scrape), and, when its
// record has a metrics address (the worker's --metrics-listen), a second
// group by that address, labelled endpoint="metrics", stage (index),
// stage_name, replica and engine_index: scrape those to read each
// replica's own series (docs/stats.md). ?endpoint=grpc or
// ?endpoint=metrics lists one kind only. Labels hold only identity, so
// a target's labels do not change while it lives; detached replicas are
// left out.
func (s *Server) replicasSD(w http.ResponseWriter, r *http.Request) {
	want := r.URL.Query().Get("endpoint")
	if want != "" && want != "grpc" && want != "metrics" {
		s.reject(w, r, badRequest("endpoint", "invalid_value", "endpoint must be grpc or metrics, got %q", want))
		return
	}
	groups := []sdTargetGroup{} // Prometheus wants [] when there is none, not null
	for _, rep := range s.b.Replicas() {
		if rep.State == orchestrator.StateDetached {
			continue
		}
		replica := strconv.FormatUint(uint64(rep.Replica), 10)
		index := strconv.Itoa(rep.EngineIndex)
		if want != "metrics" {
			groups = append(groups, sdTargetGroup{
				Targets: []string{rep.Addr},
				Labels:  map[string]string{"stage": rep.StageName, "replica": replica, "engine_index": index, "endpoint": "grpc"},
			})
		}
		if want != "grpc" && rep.MetricsAddr != "" {
			groups = append(groups, sdTargetGroup{
				Targets: []string{rep.MetricsAddr},
				Labels: map[string]string{"stage": strconv.Itoa(rep.Stage), "stage_name": rep.StageName, "replica": replica,
					"engine_index": index, "endpoint": "metrics"},
			})
		}
	}
	writeJSON(w, http.StatusOK, groups)
}

// sleep serves POST /v1/replicas/{stage}/{replica}/sleep?level=1|2.
func (s *Server) sleep(w http.ResponseWriter, r *http.Request) {
	level := 1
	if v := r.URL.Query().Get("level"); v != "" {
		n, err := strconv.Atoi(v)
		if _, lerr := stagepb.SleepStateForLevel(n); err != nil || lerr != nil {
			s.reject(w, r, badRequest("level", "invalid_value", "level must be 1 (offload weights) or 2 (discard all), got %q", v))
			return
		}
		level = n
	}
	s.changeSleep(w, r, func(ctx context.Context, stage int, replica uint32) (stagepb.SleepState, error) {
		return s.b.Sleep(ctx, stage, replica, level)
	})
}

// wakeUp serves POST /v1/replicas/{stage}/{replica}/wake_up.
func (s *Server) wakeUp(w http.ResponseWriter, r *http.Request) {
	s.changeSleep(w, r, s.b.WakeUp)
}

// changeSleep resolves {stage} (a name or an index) and {replica}, runs call on
// the head and answers the replica's new sleep state.
func (s *Server) changeSleep(w http.ResponseWriter, r *http.Request, call func(context.Context, int, uint32) (stagepb.SleepState, error)) {
	stage, err := s.b.ResolveStage(r.PathValue("stage"))
	if err != nil {
		e := fromBackend(err, requestIDFrom(r.Context()))
		s.reject(w, r, notFound("stage", "unknown_stage", "%s", e.Message))
		return
	}
	id, err := strconv.ParseUint(r.PathValue("replica"), 10, 32)
	if err != nil {
		s.reject(w, r, notFound("replica", "unknown_replica", "no replica %q: replica ids are non-negative integers", r.PathValue("replica")))
		return
	}
	ctx, cancel := context.WithTimeout(r.Context(), adminTimeout)
	defer cancel()
	state, err := call(ctx, stage, uint32(id))
	if err != nil {
		s.fail(w, r, nil, err)
		return
	}
	s.log.InfoContext(r.Context(), "httpapi: replica sleep state changed", "request_id", requestIDFrom(r.Context()),
		"stage", stage, "replica", id, "sleep_state", state.Name())
	writeJSON(w, http.StatusOK, sleepAnswer{
		Stage: stage, StageName: s.b.Pipeline().Stages[stage].Name, Replica: uint32(id), SleepState: state.Name(),
	})
}
