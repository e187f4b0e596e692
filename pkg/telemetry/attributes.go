package telemetry

import "go.opentelemetry.io/otel/attribute"

// Span names of the request path (docs/contracts.md, Tracing). They are a contract:
// dashboards and `troupe trace` users search for them.
const (
	// SpanRequest is the head's internal span around one request, under the
	// otelhttp server span.
	SpanRequest = "troupe.request"
	// SpanStagePrefix starts the name of the span of one stage attempt:
	// StageSpanName("thinker") is "troupe.stage thinker".
	SpanStagePrefix = "troupe.stage "
	// SpanQueue, SpanPrefill and SpanDecode are the worker's engine phases.
	SpanQueue   = "queue"
	SpanPrefill = "prefill"
	SpanDecode  = "decode"
	// SpanTensorPush is a producing worker's transfer of a request's
	// tensors to one consuming attempt (KeyTensorBytes, KeyTensorPushes).
	SpanTensorPush = "troupe.tensors.push"
)

// StageSpanName is the name of the span of one attempt at stage name.
func StageSpanName(stage string) string { return SpanStagePrefix + stage }

// Attribute keys of troupe's own spans.
const (
	KeyStageID     = attribute.Key("troupe.stage.id")     // int: the stage's index in the pipeline
	KeyStageName   = attribute.Key("troupe.stage.name")   // string
	KeyReplicaID   = attribute.Key("troupe.replica.id")   // int: the replica id, not the engine index
	KeyEngineIndex = attribute.Key("troupe.engine.index") // int: assigned by the head's registry
	KeyAttempt     = attribute.Key("troupe.attempt")      // int: 1 for the first try of a stage
	KeyRequestID   = attribute.Key("troupe.request.id")   // string: the X-Request-Id
	// Tensors sent worker to worker: bytes and pushes, on the producer's
	// transfer span and (bytes) on its stage attempt's span.
	KeyTensorBytes  = attribute.Key("troupe.tensors.bytes")  // int
	KeyTensorPushes = attribute.Key("troupe.tensors.pushes") // int

	// Routing of a stage attempt (docs/routing.md).
	KeyRoutePolicy = attribute.Key("troupe.route.policy") // string: the stage's policy
	KeyRouteReason = attribute.Key("troupe.route.reason") // string: rotation, load, prefix_match, affinity, load_fallback
	// prefix_aware only: leading blocks of the input the chosen replica
	// holds, the input's blocks, and who said so (engine or head).
	KeyRoutePrefixMatchBlocks = attribute.Key("troupe.route.prefix_match_blocks")
	KeyRoutePrefixInputBlocks = attribute.Key("troupe.route.prefix_input_blocks")
	KeyRoutePrefixSource      = attribute.Key("troupe.route.prefix_source")
)

// GenAI semantic convention keys (gen_ai.*). They are declared here because
// the semconv packages of the SDK in use no longer ship them; the test
// checks them against the last semconv version that did.
const (
	KeyGenAIOperationName         = attribute.Key("gen_ai.operation.name")
	KeyGenAIRequestModel          = attribute.Key("gen_ai.request.model")
	KeyGenAIRequestMaxTokens      = attribute.Key("gen_ai.request.max_tokens")
	KeyGenAIRequestTemperature    = attribute.Key("gen_ai.request.temperature")
	KeyGenAIUsageInputTokens      = attribute.Key("gen_ai.usage.input_tokens")
	KeyGenAIUsageOutputTokens     = attribute.Key("gen_ai.usage.output_tokens")
	KeyGenAIResponseFinishReasons = attribute.Key("gen_ai.response.finish_reasons")
	KeyGenAIResponseID            = attribute.Key("gen_ai.response.id")
)

// Values of gen_ai.operation.name used by troupe.
const (
	GenAIOperationChat           = "chat"            // /v1/chat/completions
	GenAIOperationTextCompletion = "text_completion" // /v1/completions
	// GenAIOperationGenerateContent: /v1/audio/speech (semconv has no
	// text-to-speech operation; this is its generic one).
	GenAIOperationGenerateContent = "generate_content"
)

// StageAttributes are the attributes of a `troupe.stage <name>` span.
func StageAttributes(stageID int, stageName string, replicaID uint64, engineIndex, attempt int) []attribute.KeyValue {
	return []attribute.KeyValue{
		KeyStageID.Int(stageID),
		KeyStageName.String(stageName),
		KeyReplicaID.Int64(int64(replicaID)),
		KeyEngineIndex.Int(engineIndex),
		KeyAttempt.Int(attempt),
	}
}

// RouteAttributes describe why a stage attempt went to its replica.
// prefixSource is "" for picks that did not look at prefixes, and then the
// block counts are left out.
func RouteAttributes(policy, reason, prefixSource string, matchBlocks, inputBlocks int) []attribute.KeyValue {
	attrs := []attribute.KeyValue{KeyRoutePolicy.String(policy), KeyRouteReason.String(reason)}
	if prefixSource != "" {
		attrs = append(attrs,
			KeyRoutePrefixSource.String(prefixSource),
			KeyRoutePrefixMatchBlocks.Int(matchBlocks),
			KeyRoutePrefixInputBlocks.Int(inputBlocks))
	}
	return attrs
}

// GenAIRequestAttributes describe a request: operation ("chat",
// "text_completion"), model, and max_tokens and temperature when given
// (maxTokens <= 0 and a nil temperature are left out).
func GenAIRequestAttributes(operation, model string, maxTokens int, temperature *float64) []attribute.KeyValue {
	attrs := []attribute.KeyValue{
		KeyGenAIOperationName.String(operation),
		KeyGenAIRequestModel.String(model),
	}
	if maxTokens > 0 {
		attrs = append(attrs, KeyGenAIRequestMaxTokens.Int(maxTokens))
	}
	if temperature != nil {
		attrs = append(attrs, KeyGenAIRequestTemperature.Float64(*temperature))
	}
	return attrs
}

// GenAIUsageAttributes describe what a request or stage consumed and why it
// finished (finish reasons such as "stop" or "length"; none is left out).
func GenAIUsageAttributes(inputTokens, outputTokens int64, finishReasons ...string) []attribute.KeyValue {
	attrs := []attribute.KeyValue{
		KeyGenAIUsageInputTokens.Int64(inputTokens),
		KeyGenAIUsageOutputTokens.Int64(outputTokens),
	}
	if len(finishReasons) > 0 {
		attrs = append(attrs, KeyGenAIResponseFinishReasons.StringSlice(finishReasons))
	}
	return attrs
}
