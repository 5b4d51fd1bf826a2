//! Who exported a span: the OpenTelemetry resource of each dflash process,
//! named as the semantic conventions expect (`service.name`,
//! `service.instance.id`, `service.version`).
//!
//! Each process says what it is ([`Service`]) and which one it is (its
//! target id, its drafter id, ...): under `dflash local` every child gets the
//! same environment, so only the process itself can tell two drafters apart.
//! What an operator sets in the environment still wins: `OTEL_SERVICE_NAME`
//! over the name, and any key of `OTEL_RESOURCE_ATTRIBUTES` (e.g.
//! `deployment.environment.name=prod,service.namespace=llm`) over ours.

use opentelemetry::KeyValue;
use opentelemetry_sdk::resource::TelemetryResourceDetector;
use opentelemetry_sdk::Resource;

/// The kind of dflash process: its `service.name`, one scheme for all.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Service {
    /// `broker`: the queue (and the shared model).
    Broker,
    /// `target-server`: produces hidden-state samples.
    TargetServer,
    /// `drafter-server`: trains on them.
    DrafterServer,
    /// `dflash evaluate`: τ of the shared model while the run trains.
    Evaluator,
}

impl Service {
    /// Its `service.name`.
    pub fn name(self) -> &'static str {
        match self {
            Service::Broker => "dflash-broker",
            Service::TargetServer => "dflash-target-server",
            Service::DrafterServer => "dflash-drafter-server",
            Service::Evaluator => "dflash-evaluator",
        }
    }
}

/// What a process says about itself for its resource.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ServiceIdentity {
    pub service: Service,
    /// `service.instance.id`: the target id, the drafter id, the evaluator
    /// id; for the broker, one per process ([`process_instance_id`]).
    pub instance_id: String,
    /// `service.version`: the caller's `env!("CARGO_PKG_VERSION")`, so each
    /// binary reports the version it was built as.
    pub version: String,
}

impl ServiceIdentity {
    pub fn new(service: Service, instance_id: impl Into<String>, version: &str) -> Self {
        ServiceIdentity {
            service,
            instance_id: instance_id.into(),
            version: version.to_string(),
        }
    }
}

/// An instance id for a process that has no id of its own (the broker):
/// `host:pid`, unique among the processes running at once, which is what
/// `service.instance.id` asks for (a restarted broker is another instance).
pub fn process_instance_id() -> String {
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname")
        .ok()
        .map(|host| host.trim().to_string())
        .filter(|host| !host.is_empty())
        .or_else(|| std::env::var("HOSTNAME").ok())
        .unwrap_or_else(|| "localhost".to_string());
    format!("{host}:{}", std::process::id())
}

/// The resource of `identity`, with `OTEL_SERVICE_NAME` and
/// `OTEL_RESOURCE_ATTRIBUTES` from the environment applied over it.
pub(crate) fn resource_from_env(identity: &ServiceIdentity) -> Resource {
    let non_empty = |name: &str| {
        std::env::var(name)
            .ok()
            .filter(|value| !value.trim().is_empty())
    };
    resource_for(
        identity,
        non_empty("OTEL_SERVICE_NAME").as_deref(),
        non_empty("OTEL_RESOURCE_ATTRIBUTES").as_deref(),
    )
}

/// The resource: ours, then the SDK's `telemetry.sdk.*`, then the
/// operator's attributes, then the operator's service name (each later one
/// wins on a shared key, as the specification orders them).
pub(crate) fn resource_for(
    identity: &ServiceIdentity,
    otel_service_name: Option<&str>,
    otel_resource_attributes: Option<&str>,
) -> Resource {
    let mut builder = Resource::builder_empty()
        .with_attributes([
            KeyValue::new("service.name", identity.service.name()),
            KeyValue::new("service.instance.id", identity.instance_id.clone()),
            KeyValue::new("service.version", identity.version.clone()),
        ])
        .with_detector(Box::new(TelemetryResourceDetector));
    if let Some(attributes) = otel_resource_attributes {
        builder = builder.with_attributes(parse_resource_attributes(attributes));
    }
    if let Some(name) = otel_service_name {
        builder = builder.with_service_name(name.trim().to_string());
    }
    builder.build()
}

/// `OTEL_RESOURCE_ATTRIBUTES`: `key=value` pairs separated by commas, values
/// percent-encoded (W3C baggage's octets). A pair without `=` or with an
/// empty key is skipped, as the specification allows, rather than failing
/// the process over its telemetry.
fn parse_resource_attributes(text: &str) -> Vec<KeyValue> {
    text.split(',')
        .filter_map(|pair| {
            let (key, value) = pair.split_once('=')?;
            let key = key.trim();
            (!key.is_empty()).then(|| KeyValue::new(key.to_string(), percent_decode(value.trim())))
        })
        .collect()
}

/// Decodes `%XX` escapes; a malformed escape is kept as written.
fn percent_decode(text: &str) -> String {
    let bytes = text.as_bytes();
    let mut decoded = Vec::with_capacity(bytes.len());
    let mut index = 0;
    while index < bytes.len() {
        let escaped = (bytes[index] == b'%')
            .then(|| bytes.get(index + 1..index + 3))
            .flatten()
            .and_then(|hex| std::str::from_utf8(hex).ok())
            .and_then(|hex| u8::from_str_radix(hex, 16).ok());
        match escaped {
            Some(byte) => {
                decoded.push(byte);
                index += 3;
            }
            None => {
                decoded.push(bytes[index]);
                index += 1;
            }
        }
    }
    String::from_utf8_lossy(&decoded).into_owned()
}

#[cfg(test)]
mod tests {
    use super::*;
    use opentelemetry::Key;

    fn attribute(resource: &Resource, key: &'static str) -> Option<String> {
        resource
            .get(&Key::from_static_str(key))
            .map(|value| value.to_string())
    }

    fn drafter() -> ServiceIdentity {
        ServiceIdentity::new(Service::DrafterServer, "drafter-1", "1.2.3")
    }

    #[test]
    fn each_process_names_itself() {
        let resource = resource_for(&drafter(), None, None);
        assert_eq!(
            attribute(&resource, "service.name").as_deref(),
            Some("dflash-drafter-server")
        );
        assert_eq!(
            attribute(&resource, "service.instance.id").as_deref(),
            Some("drafter-1")
        );
        assert_eq!(
            attribute(&resource, "service.version").as_deref(),
            Some("1.2.3")
        );
        assert_eq!(
            attribute(&resource, "telemetry.sdk.name").as_deref(),
            Some("opentelemetry")
        );
    }

    #[test]
    fn the_operator_environment_wins() {
        let resource = resource_for(
            &drafter(),
            Some(" trainer "),
            Some("service.name=ignored, deployment.environment.name=prod%2Ceu ,bad,=x,service.instance.id=pod-7"),
        );
        assert_eq!(
            attribute(&resource, "service.name").as_deref(),
            Some("trainer")
        );
        assert_eq!(
            attribute(&resource, "deployment.environment.name").as_deref(),
            Some("prod,eu")
        );
        assert_eq!(
            attribute(&resource, "service.instance.id").as_deref(),
            Some("pod-7")
        );
        assert_eq!(
            attribute(&resource, "service.version").as_deref(),
            Some("1.2.3")
        );
        // OTEL_RESOURCE_ATTRIBUTES' service.name counts when OTEL_SERVICE_NAME is unset.
        let resource = resource_for(&drafter(), None, Some("service.name=from-attributes"));
        assert_eq!(
            attribute(&resource, "service.name").as_deref(),
            Some("from-attributes")
        );
    }

    #[test]
    fn service_names_share_one_scheme() {
        for service in [
            Service::Broker,
            Service::TargetServer,
            Service::DrafterServer,
            Service::Evaluator,
        ] {
            assert!(service.name().starts_with("dflash-"), "{service:?}");
        }
        assert_eq!(percent_decode("a%2"), "a%2");
        assert_eq!(percent_decode("%zz%41"), "%zzA");
        assert!(process_instance_id().ends_with(&format!(":{}", std::process::id())));
    }
}
