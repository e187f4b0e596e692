package stagepb

// Content part kinds (ContentPart.kind). A chat message's content is text,
// or parts of these kinds in order; engines list the media kinds they take
// in HealthResponse.input_parts.
const (
	PartText  = "text"
	PartImage = "image"
	PartAudio = "audio"
	PartVideo = "video"
)

// MediaPartKinds lists every media kind, the kinds input_parts may name.
var MediaPartKinds = [...]string{PartImage, PartAudio, PartVideo}
