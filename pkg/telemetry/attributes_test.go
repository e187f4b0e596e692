package telemetry

import (
	"testing"

	"github.com/stretchr/testify/assert"
	"go.opentelemetry.io/otel/attribute"
	semconv "go.opentelemetry.io/otel/semconv/v1.40.0"
)

func TestGenAIKeysMatchSemanticConventions(t *testing.T) {
	// v1.40.0 is the last semconv package of the SDK that ships gen_ai keys.
	assert.Equal(t, semconv.GenAIOperationNameKey, KeyGenAIOperationName)
	assert.Equal(t, semconv.GenAIRequestModelKey, KeyGenAIRequestModel)
	assert.Equal(t, semconv.GenAIRequestMaxTokensKey, KeyGenAIRequestMaxTokens)
	assert.Equal(t, semconv.GenAIRequestTemperatureKey, KeyGenAIRequestTemperature)
	assert.Equal(t, semconv.GenAIUsageInputTokensKey, KeyGenAIUsageInputTokens)
	assert.Equal(t, semconv.GenAIUsageOutputTokensKey, KeyGenAIUsageOutputTokens)
	assert.Equal(t, semconv.GenAIResponseFinishReasonsKey, KeyGenAIResponseFinishReasons)
	assert.Equal(t, semconv.GenAIResponseIDKey, KeyGenAIResponseID)
	assert.Equal(t, semconv.GenAIOperationNameChat.Value.AsString(), GenAIOperationChat)
	assert.Equal(t, semconv.GenAIOperationNameTextCompletion.Value.AsString(), GenAIOperationTextCompletion)
}

func TestAttributeHelpers(t *testing.T) {
	set := func(kvs []attribute.KeyValue) map[attribute.Key]attribute.Value {
		m := map[attribute.Key]attribute.Value{}
		for _, kv := range kvs {
			m[kv.Key] = kv.Value
		}
		return m
	}
	st := set(StageAttributes(2, "vocoder", 5, 9, 2))
	assert.Equal(t, int64(2), st["troupe.stage.id"].AsInt64())
	assert.Equal(t, "vocoder", st["troupe.stage.name"].AsString())
	assert.Equal(t, int64(5), st["troupe.replica.id"].AsInt64())
	assert.Equal(t, int64(9), st["troupe.engine.index"].AsInt64())
	assert.Equal(t, int64(2), st["troupe.attempt"].AsInt64())
	assert.Equal(t, "troupe.stage vocoder", StageSpanName("vocoder"))

	route := set(RouteAttributes("prefix_aware", "prefix_match", "engine", 12, 20))
	assert.Equal(t, "prefix_aware", route["troupe.route.policy"].AsString())
	assert.Equal(t, "prefix_match", route["troupe.route.reason"].AsString())
	assert.Equal(t, "engine", route["troupe.route.prefix_source"].AsString())
	assert.Equal(t, int64(12), route["troupe.route.prefix_match_blocks"].AsInt64())
	assert.Equal(t, int64(20), route["troupe.route.prefix_input_blocks"].AsInt64())
	plain := set(RouteAttributes("round_robin", "rotation", "", 0, 0))
	assert.Len(t, plain, 2, "no prefix attributes for a pick that did not look at prefixes")

	temp := 0.7
	req := set(GenAIRequestAttributes(GenAIOperationChat, "troupe-omni-sim", 128, &temp))
	assert.Equal(t, "chat", req["gen_ai.operation.name"].AsString())
	assert.Equal(t, "troupe-omni-sim", req["gen_ai.request.model"].AsString())
	assert.Equal(t, int64(128), req["gen_ai.request.max_tokens"].AsInt64())
	assert.InDelta(t, 0.7, req["gen_ai.request.temperature"].AsFloat64(), 1e-12)
	bare := set(GenAIRequestAttributes(GenAIOperationTextCompletion, "m", 0, nil))
	assert.NotContains(t, bare, attribute.Key("gen_ai.request.max_tokens"))
	assert.NotContains(t, bare, attribute.Key("gen_ai.request.temperature"))

	use := set(GenAIUsageAttributes(11, 42, "stop"))
	assert.Equal(t, int64(11), use["gen_ai.usage.input_tokens"].AsInt64())
	assert.Equal(t, int64(42), use["gen_ai.usage.output_tokens"].AsInt64())
	assert.Equal(t, []string{"stop"}, use["gen_ai.response.finish_reasons"].AsStringSlice())
	assert.NotContains(t, set(GenAIUsageAttributes(1, 2)), attribute.Key("gen_ai.response.finish_reasons"))
}
